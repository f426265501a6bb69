"""``python -m loadtests.bench_engine``: see :mod:`loadtests.bench_engine`."""

from loadtests.bench_engine.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
