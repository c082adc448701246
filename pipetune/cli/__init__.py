"""The ``pipetune`` command line."""
