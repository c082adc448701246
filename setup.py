"""What pyproject.toml cannot say: the job configs in ``configs/`` ship as the package
``pipetune_configs`` (``--module pipetune_configs``), a name that cannot clash with a user's own
``configs``; everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["pipetune*", "torchtitan_patches*", "profiling*"]), "pipetune_configs"],
      package_dir={"pipetune_configs": "configs"})
