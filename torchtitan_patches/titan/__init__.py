"""TorchTitan's models and components, extended where pipetune's per-step plans need them (the
trainer itself is ``torchtitan_patches.trainer``; job configs are in ``configs/``).

* ``model_parts``: the stage layout handed to TorchTitan's splitter and ``parallelize_fn``;
* ``dataloader``: pipetune's stateful loader as a ``BaseDataLoader``;
* ``stages``: TorchTitan model parts as the executor's stages, the vision encoder (whole or in chunks)
  as the plan's encoder actions;
* ``model_spec``: TorchTitan's Muse Glimmer spec with attention that trains on CPU, and pipetune's
  planning shapes derived from the TorchTitan config;
* ``document_attention`` / ``vision``: the CPU attention backends behind TorchTitan's interfaces;
* ``tokenizer``: pipetune's byte-level tokenizer as a ``BaseTokenizer``.

TorchTitan 0.3.0 on a CPU and on torch 2.13 needs ``torchtitan_patches.compat``; the data set and
latency table a job reads come from ``python -m profiling.prepare_job``.
"""
