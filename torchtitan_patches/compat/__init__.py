"""The real patches for version gaps: TorchTitan 0.3.0 was written against torch 2.14 and runs here
on torch 2.13 (``torch_compat``), and it assumes an accelerator where these jobs may run on a CPU
with gloo (``cpu_device``). Both rebind names inside torch or TorchTitan at run time; they can go
once the versions meet and TorchTitan runs on CPU by itself. On CPU, profiling, stage timing and
the testbed also keep freed memory in the process (``cpu_allocator``).
"""
