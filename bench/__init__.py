"""Benchmarks (not tests): see docs/PERF.md. Run from the repo root, e.g. `python bench/drafter_step.py`."""
