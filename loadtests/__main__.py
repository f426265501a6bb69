"""``python -m loadtests serve|compare ...``: the serving benchmarks' CLI (what ``kvroute bench`` runs)."""

from loadtests.bench_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
