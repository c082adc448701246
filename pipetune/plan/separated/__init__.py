"""DIP's modality-separated layout: the vision encoder in chunks of its own on every rank, its
partitioner, the segment search and the dual-queue interleaving of its tables."""
