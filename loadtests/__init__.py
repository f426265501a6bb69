"""Benchmarks and load generators, run as scripts (``python -m loadtests.<name>``), not as tests."""
