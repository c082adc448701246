"""Per-iteration packing quality: micro-batch count, FLOPs imbalance, token utilisation."""

from __future__ import annotations

import numpy as np

from pipetune.packing.flops import FlopsModel
from pipetune.packing.groups import Packing


def packing_stats(lengths: np.ndarray, packing: Packing, flops: FlopsModel) -> dict:
    """``imbalance`` = max / mean backbone FLOPs over micro-batches (1.0 is perfect balance);
    ``utilisation`` = packed tokens / (micro-batches x capacity)."""
    mb_flops = packing.per_micro_batch(flops.sequence_flops(lengths))
    tokens = int(lengths.sum())
    m = packing.num_micro_batches
    return {
        "micro_batches": m,
        "imbalance": float(mb_flops.max() / mb_flops.mean()),
        "utilisation": tokens / (m * packing.capacity),
        "tokens": tokens,
        "max_mb_tflops": float(mb_flops.max() / 1e12),
    }
