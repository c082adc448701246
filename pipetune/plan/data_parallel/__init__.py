"""The split of each global batch over data-parallel replicas, and each replica's plan of its share."""
