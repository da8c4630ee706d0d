"""Benchmarks of rltool: run one with `python -m benchmarks.NAME` from the repository root;
the shared harness is benchmarks/harness.py, the method in docs/benchmarks.md."""
