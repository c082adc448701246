"""pipetune's pieces for TorchTitan's own models, plugged in at TorchTitan's extension points.

* ``attention``: document-masked attention that trains on CPU, behind TorchTitan's inner-attention
  interface (a ``VarlenAttention.Config`` subclass, so models and the trainer treat it as varlen);
* ``vision``: the Muse Glimmer vision encoder with dense masks instead of compiled BlockMasks;
* ``model_spec``: a TorchTitan ``ModelSpec`` with those swapped in, and pipetune's planning
  ``ModelConfig`` derived from the TorchTitan model config (one source of truth);
* ``stages``: one pipeline stage per layer layout, split with TorchTitan's module splitter;
* ``dataloader``: a TorchTitan ``BaseDataLoader`` around ``PipeTuneDataLoader``;
* ``config_registry``: ``--module torchtitan_patches.titan --config <fn>`` job configs.

Not here yet: a trainer that executes pipetune's plans (the stock ``Trainer`` ignores the
``pipetune`` config section), checkpointing of planner state.
"""
