"""pipetune's TorchTitan job configs: ``--module configs --config <fn>`` (see ``config_registry``)."""
