"""The per-iteration search of the co-located layouts (PipeTune Alg. 2): micro-batch sizes and
counts, clustered orders, encoder placement, schedule families."""
