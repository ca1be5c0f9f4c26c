"""pytest-benchmark hot paths and the side-by-side runner (python -m benchmarks.compare)."""
