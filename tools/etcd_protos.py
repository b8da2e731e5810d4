"""Generate Python stubs for etcd's v3 gRPC API from the .proto files the distribution
ships (Debian's ``golang-etcd-server-dev``, 3.4.23), without copying them into the project.

    python tools/etcd_protos.py smb_protocol/_proto [--gocode /usr/share/gocode/src]

etcd's files import ``gogoproto/gogo.proto`` (Go code-generation options) and
``google/api/annotations.proto`` (routes of etcd's JSON gateway). Neither means anything
to a Python client, and the second would register ``google/api/annotations.proto`` in
the process's descriptor pool, where another library's copy of it would clash. So:

1. protoc parses etcd's files with the include paths of what Debian ships beside them
   (gogo-protobuf's and grpc-gateway's), checking them as they are, and writes a
   descriptor set;
2. the descriptors lose those two imports and every option they set (the options are
   extensions unknown here, so they are unknown fields: dropped whole);
3. protoc generates the messages (``*_pb2.py`` and ``.pyi``) from that descriptor set,
   under ``<out>/etcd/...``; tools/fix_proto_imports.py then roots their imports at
   ``smb_protocol._proto``.

The services are not generated: :mod:`smb_server.controller.stores.etcd.kv` binds the methods
it calls (``/etcdserverpb.KV/Range`` ...) on its own, typed.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
from importlib.resources import files

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

GOCODE = "/usr/share/gocode/src"
ETCD_FILES = ("etcd/mvcc/mvccpb/kv.proto", "etcd/auth/authpb/auth.proto",
              "etcd/etcdserver/etcdserverpb/rpc.proto")
INCLUDES = ("go.etcd.io",                                            # etcd/...
            "github.com/gogo/protobuf",                              # gogoproto/gogo.proto
            "github.com/grpc-ecosystem/grpc-gateway/third_party/googleapis")  # google/api/...
DROPPED_IMPORTS = {"gogoproto/gogo.proto", "google/api/annotations.proto"}
PACKAGE = "golang-etcd-server-dev"


def _protoc(args: list[str]) -> None:
    well_known = str(files("grpc_tools") / "_proto")
    if protoc.main(["protoc", *args, f"-I{well_known}"]) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")


def _strip(fds: descriptor_pb2.FileDescriptorSet) -> descriptor_pb2.FileDescriptorSet:
    """etcd's files alone, without the Go and gateway imports and their options."""
    out = descriptor_pb2.FileDescriptorSet()
    for f in fds.file:
        if f.name not in ETCD_FILES:
            continue
        if f.public_dependency or f.weak_dependency:
            raise SystemExit(f"{f.name}: public or weak imports are not handled")
        kept = [d for d in f.dependency if d not in DROPPED_IMPORTS]
        del f.dependency[:]
        f.dependency.extend(kept)
        f.DiscardUnknownFields()   # the gogoproto and google.api options
        out.file.append(f)
    if sorted(f.name for f in out.file) != sorted(ETCD_FILES):
        raise SystemExit("protoc did not parse every etcd file")
    return out


def generate(out: str, gocode: str = GOCODE) -> None:
    root = pathlib.Path(gocode)
    missing = [name for name in ETCD_FILES if not (root / INCLUDES[0] / name).is_file()]
    if missing:
        raise SystemExit(f"etcd's .proto files are missing under {root / INCLUDES[0]} ({', '.join(missing)}); "
                         f"install them: apt-get install {PACKAGE} (make apt does)")
    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smb-etcd-proto-") as tmp:
        full, stripped = f"{tmp}/full.pb", f"{tmp}/etcd.pb"
        _protoc([*(f"-I{root / inc}" for inc in INCLUDES), "--include_imports",
                 f"--descriptor_set_out={full}", *ETCD_FILES])
        fds = descriptor_pb2.FileDescriptorSet.FromString(pathlib.Path(full).read_bytes())
        pathlib.Path(stripped).write_bytes(_strip(fds).SerializeToString())
        _protoc([f"--descriptor_set_in={stripped}", f"--python_out={out}", f"--pyi_out={out}", *ETCD_FILES])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="where the stubs go (smb_protocol/_proto)")
    parser.add_argument("--gocode", default=GOCODE, help=f"Go source root of the package (default {GOCODE})")
    args = parser.parse_args(argv)
    generate(args.out, args.gocode)


if __name__ == "__main__":
    main(sys.argv[1:])
