"""Log setup of the ``smb`` command: plain text lines or JSON objects, one per line.

The JSON form (``log_format = "json"``, ``--log-format json`` or
``SMB_LOG_FORMAT=json``) suits journald forwarders and log shippers: every record is
one object with ``ts`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``msg``,
``pid`` and ``thread``, plus ``exc`` with the traceback when there is one, plus every
field passed through ``extra=`` (values that are not JSON types are written with
``str``). Daemons add their identity (``daemon``, ``server_id``) to every record via
:func:`set_context`.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

log = logging.getLogger(__name__)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_context: dict[str, Any] = {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module documentation for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
            "logger": record.name, "msg": record.getMessage(), "pid": record.process,
            "thread": record.threadName}
        out.update(_context)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """(Re)configure the root logger: ``level`` (DEBUG, INFO, WARNING, ERROR) and
    ``fmt`` (text or json). Raises ValueError for anything else."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)


def set_context(**fields: Any) -> None:
    """Fields added to every JSON record from now on (``None`` removes one)."""
    for key, value in fields.items():
        if value is None:
            _context.pop(key, None)
        else:
            _context[key] = value
