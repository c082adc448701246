"""Calibration of the latency table from measured steps: the per-action fit (``action_fit``), the
online window refit anchored by calibration steps (``online``), the per-mbs correction
(``correction``) and the CPU testbed's pair-based fits (``pairs``)."""
