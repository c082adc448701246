"""Execution of iteration plans on torch.distributed: the executor, plan distribution from each replica's lead,
the non-pipelined reference and the clock the executor times its actions with.

The profiler (``profiling``) builds on this package; nothing here imports it.
"""
