"""pipetune's TorchTitan job configs, installed as the package ``pipetune_configs``:
``--module pipetune_configs --config <fn>`` (see ``config_registry``)."""
