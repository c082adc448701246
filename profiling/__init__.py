"""Offline profiling of a model's per-component latencies into a latency table (needs torch)."""
