"""Offline profiling of a model's per-component latencies into a latency table (needs torch), and
``prepare_job``: the data set and latency table a pipetune TorchTitan job reads. The profiler
builds on the runtime (``torchtitan_patches``); the runtime never imports it."""
