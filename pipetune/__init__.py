"""pipetune: per-iteration tuning of pipeline-parallel VLM training.

The planning core in this package (samples, packing, cost model, simulator, planner) is pure
Python + numpy; it never imports torch. The runtime lives in ``torchtitan_patches``.
"""

__version__ = "0.1.0"
