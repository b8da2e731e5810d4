"""The native part of the package (smb_protocol/_native.c); everything else is in
pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "smb_protocol._native", ["smb_protocol/_native.c"],
    # no fused multiply-add: float results are the same on every CPU and path
    extra_compile_args=["-O3", "-ffp-contract=off", "-Wall", "-Wextra"],
)])
