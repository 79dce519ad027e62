"""Benchmarks of hf_fixedpoint (run from the repository root as ``python -m benchmarks.<name>``)."""
