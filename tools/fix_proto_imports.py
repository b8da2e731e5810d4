"""Rewrite the imports of generated gRPC stubs so they live under smb_protocol._proto.

protoc emits ``from smb.v1 import x_pb2``; the stubs are installed as
``smb_protocol._proto.smb.v1`` so that they never clash with another ``smb`` package.
"""
from __future__ import annotations

import pathlib
import re
import sys

PATTERN = re.compile(r"^from smb\.v1 import", re.MULTILINE)


def main(root: str) -> None:
    base = pathlib.Path(root)
    for pkg in (base, base / "smb", base / "smb" / "v1"):
        (pkg / "__init__.py").touch()
    for path in (base / "smb" / "v1").glob("*.py*"):
        text = path.read_text()
        fixed = PATTERN.sub("from smb_protocol._proto.smb.v1 import", text)
        if fixed != text:
            path.write_text(fixed)


if __name__ == "__main__":
    main(sys.argv[1])
