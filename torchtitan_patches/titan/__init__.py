"""TorchTitan's components, extended where pipetune's per-step plans need them (the
trainer itself is ``torchtitan_patches.trainer``, the models ``torchtitan_patches.models``; job
configs are in ``configs/``).

* ``model_parts``: the stage layout handed to TorchTitan's splitter and ``parallelize_fn``;
* ``dataloader``: pipetune's stateful loader as a ``BaseDataLoader``;
* ``metrics``: model FLOPs with the encoder, through TorchTitan's metrics processor;
* ``checkpoint_entries`` / ``run_outcome``: the trainer's checkpoint entries, its runs and records;
* ``job_checks``: TorchTitan settings pipetune refuses;
* ``tokenizer``: pipetune's byte-level tokenizer as a ``BaseTokenizer``.

TorchTitan 0.3.0 on a CPU and on torch 2.13 needs ``torchtitan_patches.compat``; the data set and
latency table a job reads come from ``python -m profiling.prepare_job``.
"""
