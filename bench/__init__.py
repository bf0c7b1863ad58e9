"""Benchmarks: each `bench/*_bench.py` measures one thing against its floor, side by side in one run."""
