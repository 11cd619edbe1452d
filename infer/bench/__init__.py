"""Measurement apart from serving: the bench CLI (`python -m infer.bench`), forward costs, the ideal speculative
speedup, the GPU check and the tensor-parallel report."""
