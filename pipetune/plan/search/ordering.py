"""Candidate micro-batch orders: cluster by estimated latency, then permute the clusters (PipeTune Sec. 5.2).

Exhaustive permutation of ``m`` micro-batches is out of reach, so micro-batches are grouped by
their estimated latency (backbone forward + backward over all stages plus the encoder's backward,
and the encoder's forward, summed over the micro-batch's sub-microbatches and encoder chunks)
with Ward agglomerative clustering from scikit-learn (deterministic: no random initialisation),
and only the order of the clusters is permuted; inside a cluster, micro-batches go longest first.
Balance packing makes the micro-batches similar, which is why few clusters suffice: the paper keeps
fewer than six. The packing order and both latency-sorted orders are always included.
"""

from __future__ import annotations

from itertools import permutations

import numpy as np
from sklearn.cluster import AgglomerativeClustering

from pipetune.simulate.simulator import Latencies


def candidate_orders(lat: Latencies, max_clusters: int, sub_mb_parent=None) -> np.ndarray:
    """``[n_orders, m]`` distinct micro-batch orders to evaluate (``sub_mb_parent``: the micro-batch
    of each encoder sub-microbatch; default one per micro-batch, as co-located)."""
    m = lat.fwd.shape[0]
    parent = np.arange(m) if sub_mb_parent is None else np.asarray(sub_mb_parent, np.int64)
    per_mb = lambda x: np.bincount(parent, weights=x.sum(axis=1), minlength=m)  # noqa: E731
    backbone = (lat.fwd + lat.bwd).sum(axis=1) + per_mb(lat.encoder_bwd)
    longest_first = np.lexsort((np.arange(m), -backbone))
    base = [np.arange(m), longest_first, longest_first[::-1]]
    features = np.column_stack([backbone, per_mb(lat.encoder)])
    k = min(max_clusters, len(np.unique(features, axis=0)))
    if k >= 2:
        scale = features.std(axis=0)
        X = features / np.where(scale > 0, scale, 1.0)
        labels = AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(X)
        groups = [longest_first[labels[longest_first] == c] for c in range(k)]
        base += [np.concatenate([groups[c] for c in perm]) for perm in permutations(range(k))]
    return np.unique(np.array(base, dtype=np.int64), axis=0)
