"""The native parts of the package (smb_protocol/_native.c, the elementwise kernels;
smb_client/transports/answers.c, a collective stream's answers read without the
interpreter; smb_server/memserver/native/, the memory server's request path);
everything else is in pyproject.toml."""
from glob import glob

from setuptools import Extension, setup

# no fused multiply-add: float results are the same on every CPU and path
FLAGS = ["-O3", "-ffp-contract=off", "-Wall", "-Wextra"]

setup(ext_modules=[
    Extension("smb_protocol._native", ["smb_protocol/_native.c"], extra_compile_args=FLAGS),
    Extension("smb_client.transports._answers", ["smb_client/transports/answers.c"],
              depends=["smb_protocol/_lowat.h"], include_dirs=["smb_protocol"],
              extra_compile_args=FLAGS + ["-pthread"]),
    Extension("smb_server.memserver._native", sorted(glob("smb_server/memserver/native/*.c")),
              depends=glob("smb_server/memserver/native/*.h") + ["smb_protocol/_native.h", "smb_protocol/_lowat.h"],
              include_dirs=["smb_protocol"], extra_compile_args=FLAGS + ["-pthread"]),
])
