"""``python -m loadtests.bench_index``: see :mod:`loadtests.bench_index`."""

from loadtests.bench_index.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
