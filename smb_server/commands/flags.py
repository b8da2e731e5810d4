"""Command-line flags made from the settings schema (:mod:`smb_server.runtime.config`): one
flag per setting, with its documentation, default and variable as help."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from smb_server.runtime.config import default_of, settings

# set on the top-level parser; a daemon reads them from there (see setting_flags)
GLOBAL_SETTINGS = ("log_level", "log_format")
def add_setting_flags(p: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None) -> None:
    """One flag per setting of ``cls`` (``--<name-with-dashes>`` and its aliases), with
    the setting's documentation, default and variable as help (``only``: just these
    settings). Values stay text (None when not given) and are converted and checked by
    :func:`~smb_server.runtime.config.load`, so a bad flag is reported like a bad file key."""
    for f in settings(cls):
        if f.name in GLOBAL_SETTINGS or (only is not None and f.name not in only):
            continue
        meta = f.metadata
        default = default_of(f)
        if isinstance(default, list):
            default = ",".join(default)
        shown = f"default {default!r}" if default not in ("", None) else "default: none"
        kind = meta.get("kind") or str(f.type)
        metavar = {"int": "N", "float": "SECONDS" if f.name.endswith("_seconds") else "X",
                   "size": "SIZE", "list[str]": "A,B", "cpus": "CORES"}.get(kind, f.name.upper())
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if kind == "bool" else {}
        p.add_argument("--" + f.name.replace("_", "-"), *meta.get("aliases", ()), dest=f.name,
                       default=None, metavar=metavar, **extra,
                       help=f"{meta['doc']} ({shown}; env SMB_{f.name.upper()}; key {f.name})")


def setting_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options given on the command line that name a setting of ``cls``."""
    names = {f.name for f in settings(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}
