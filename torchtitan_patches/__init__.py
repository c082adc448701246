"""Runtime side of pipetune: ``PipeTuneTrainer`` (``trainer``, ``settings``), plan execution
(``runtime``), TorchTitan glue (``titan``), version and CPU patches (``compat``), the packed-tensor
dataloader (``data``) and pipetune's own reference VLM (``model``).

Everything here may import torch (and torch.distributed); the planning core in ``pipetune`` does not.
"""
