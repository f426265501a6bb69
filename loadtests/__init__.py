"""Benchmarks and load generators, run as commands, not as tests.

- ``python -m loadtests serve|compare`` (what ``kvroute bench`` runs; :mod:`loadtests.bench_cli`):
  the serving benchmarks of :mod:`loadtests.serving`.
- ``python -m loadtests.bench_engine``, ``loadtests.bench_gateway``, ``loadtests.bench_index``: the
  component benchmarks, each a package run by the skeleton in :mod:`loadtests.harness`.
- :mod:`loadtests.options`: the options they share.

Nothing outside loadtests imports it (``kvroute bench`` runs it as a separate process).
"""
