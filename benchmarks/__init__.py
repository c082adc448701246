"""Benchmarks (run as scripts: ``python benchmarks/NAME.py``) and the CPU testbed they switch on (``testbed``)."""
