"""Execution of iteration plans on torch.distributed: executor, plan distribution, reference."""
