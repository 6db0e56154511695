"""Benchmarks for hf_ring (not part of the installed package)."""
