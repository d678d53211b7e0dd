"""Bucket sets, CUDA-graph capture and replay, and the eager fallback."""
