"""Runtime side of pipetune: the dataloader, the VLM model and the plan-executing pipeline schedule.

Everything here may import torch (and torch.distributed); the planning core in ``pipetune`` does not.
"""
