"""Calibration of the latency table from the runtime's action timelines (``calibrate``); plan
execution itself is in ``torchtitan_patches.runtime``."""
