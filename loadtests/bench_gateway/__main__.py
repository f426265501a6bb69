"""``python -m loadtests.bench_gateway``: see :mod:`loadtests.bench_gateway`."""

from loadtests.bench_gateway.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
