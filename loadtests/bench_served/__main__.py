"""``python -m loadtests.bench_served``: see :mod:`loadtests.bench_served`."""

from loadtests.bench_served.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
