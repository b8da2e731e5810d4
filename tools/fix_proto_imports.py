"""Rewrite the imports of generated gRPC stubs so they live under smb_protocol._proto.

protoc emits ``from smb.v1 import x_pb2`` (and, for etcd's API, ``from
etcd.mvcc.mvccpb import kv_pb2``); the stubs are installed as ``smb_protocol._proto.smb.v1``
and ``smb_protocol._proto.etcd...`` so that they never clash with another ``smb`` or
``etcd`` package. Every folder of generated modules gets an ``__init__.py``.
"""
from __future__ import annotations

import pathlib
import re
import sys

PATTERN = re.compile(r"^from ((?:smb|etcd)(?:\.\w+)*) import", re.MULTILINE)


def main(root: str) -> None:
    base = pathlib.Path(root)
    (base / "__init__.py").touch()
    for top in ("smb", "etcd"):
        if not (base / top).is_dir():
            continue
        for folder in [base / top, *(p for p in (base / top).rglob("*") if p.is_dir())]:
            (folder / "__init__.py").touch()
        for path in (base / top).rglob("*.py*"):
            text = path.read_text()
            fixed = PATTERN.sub(r"from smb_protocol._proto.\1 import", text)
            if fixed != text:
                path.write_text(fixed)


if __name__ == "__main__":
    main(sys.argv[1])
