"""Benchmarks that print figures: run each from the repo root as `python -m benchmarks.<name>`."""
