"""Runtime side of pipetune: ``PipeTuneTrainer`` (``trainer``, ``settings``), plan execution
(``runtime``), TorchTitan glue (``titan``), version and CPU patches (``compat``), the packed-tensor
dataloader (``data``), pipetune's own reference VLM (``model``) and the opt-in 2-core CPU testbed
(``testbed``, which only the ``*_testbed`` job configs switch on).

Everything here may import torch (and torch.distributed); the planning core in ``pipetune`` does not.
"""
