"""The models pipetune trains, one folder per family as TorchTitan keeps them: each family's spec
under pipetune (CPU paths, size variants), planning shapes, stages and encoder chunks, and
parallelisation fixes (``muse_glimmer``, ``qwen3_5``); what they share (document attention, image
batches, planning shapes, the family dispatch in ``model_spec``); and pipetune's own reference VLM
(``reference``)."""
