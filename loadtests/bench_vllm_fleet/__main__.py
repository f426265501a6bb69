"""``python -m loadtests.bench_vllm_fleet``: see :mod:`loadtests.bench_vllm_fleet`."""

from loadtests.bench_vllm_fleet.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
