"""Exactly-once bookkeeping: the recent mutating requests of each client, by sequence number.

A client (one data plane, a random 64-bit id) numbers its mutating requests; a retry
of a request reuses its number. Before applying a request, a plane asks :meth:`DedupTable.begin`:

* a number never seen (or forgotten after an interrupted attempt that applied nothing):
  the caller owns the entry, applies the request, and calls :meth:`Entry.finish` with
  its answer (or :meth:`DedupTable.interrupt` when it stopped part way, recording in
  ``entry.applied`` how many payload bytes took effect, so that a retry skips them);
* a number whose request finished: its first answer (status, body), not applied again;
* a number whose first attempt is still running: the retry waits for it to end.

Each client keeps at most ``window`` finished entries (the oldest are forgotten);
sequence number 0 means "not tracked". One table serves every plane of a memory
server. Thread-safe; pure (no sockets, no extents).

The table lives in C (``smb_server/memserver/native/dedup.c``, module
:mod:`smb_server.memserver._native`): a native request loop, running on several threads
without the interpreter lock, consults and updates the same table as the Python paths,
so its storage (hash tables of C structs under a pthread mutex) and its operations are C
functions (declared in ``native.h``), and :class:`DedupTable` and :class:`Entry` here
are thin faces over them: one :class:`Entry` object per entry while it is alive; a
:meth:`~DedupTable.begin` that waits gives up the interpreter lock meanwhile. A finished
entry's answer is final (a second finish is ignored; its body cannot be set). Only
:meth:`DedupTable.once` is Python.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator

from smb_protocol.errors import InvalidArgument, SMBError, Status, Timeout, error_status

from . import _native

WINDOW = 4096      # finished requests remembered per client
MAX_CLIENTS = 4096  # clients remembered; the least recently seen is forgotten first

__all__ = ["DedupTable", "Entry", "Record", "WINDOW", "pack_records", "unpack_records"]

#: one handed-over entry: client, seq, what (op, extent, offset, length, dtype), applied,
#: done, status, then ``body`` bytes of body
_RECORD = struct.Struct("<QQBQQQQQ?IH")   # the last field of `what` is a dtype, or a count word's offset
Record = tuple[int, int, tuple[int, ...], int, bool, int, bytes]   # client, seq, what, applied, done, status, body


def pack_records(records: Iterable[Record], limit: int = 1 << 20) -> list[bytes]:
    """Records as messages of whole records, each at most ``limit`` bytes unless one
    record alone is larger (:meth:`DedupTable.export` -> :func:`unpack_records`)."""
    messages, out = [], bytearray()
    for client, seq, what, applied, done, status, body in records:
        op, extent, offset, length, dtype = what
        body = body[:0xFFFF]   # answers are a word or an error message
        if out and len(out) + _RECORD.size + len(body) > limit:
            messages.append(bytes(out))
            out = bytearray()
        out += _RECORD.pack(client, seq, op, extent, offset, length, dtype, applied, done, status, len(body))
        out += body
    if out:
        messages.append(bytes(out))
    return messages


def unpack_records(data: bytes | bytearray | memoryview) -> Iterator[Record]:
    """The records of :func:`pack_records`; InvalidArgument for bytes that are not."""
    view, pos = memoryview(data), 0
    while pos < len(view):
        if pos + _RECORD.size > len(view):
            raise InvalidArgument(f"exactly-once records: {len(view) - pos} trailing bytes")
        client, seq, op, extent, offset, length, dtype, applied, done, status, n = _RECORD.unpack_from(view, pos)
        pos += _RECORD.size
        if pos + n > len(view):
            raise InvalidArgument("exactly-once records: a body runs past the end")
        yield client, seq, (op, extent, offset, length, dtype), applied, done, status, bytes(view[pos:pos + n])
        pos += n


#: one request's state: running (``done`` False, ``owned`` True), interrupted (both
#: False; ``applied`` bytes took effect) or finished (``status``, ``body``); its owner
#: sets ``applied`` (and ``body``) before finishing
Entry = _native.Entry


class DedupTable(_native.DedupTable):
    """The exactly-once table (see the module's docstring): ``begin``, ``interrupt``,
    ``export``, ``forget``, ``seed`` and ``len()`` are native; ``once`` is here."""

    def __init__(self, window: int = WINDOW, max_clients: int = MAX_CLIENTS) -> None:
        super().__init__(window, max_clients)

    def once(self, client: int, seq: int, what: tuple[int, ...], timeout: float,
             run: Callable[[Entry], bytes | None]) -> tuple[bool, Entry, bytes]:
        """Run a numbered request at most once: ``(True, entry, body)`` after ``run(entry)``
        applied it (``run`` counts in ``entry.applied`` what took effect, and skips what
        an interrupted attempt applied); ``(False, entry, b"")`` for a repeat of a
        finished one, whose first answer is ``entry.status``/``entry.body``. A failure of
        ``run`` after something took effect is remembered as the answer, unless the
        error says it is ``resumable`` (a replicated request that timed out waiting for
        its backups: the retry resumes after ``entry.applied``); one before is forgotten
        (the retry runs it). Typed errors: Timeout while another attempt runs
        past ``timeout`` seconds, InvalidArgument for a number reused for another
        request."""
        try:
            fresh, entry = self.begin(client, seq, timeout, what)
        except TimeoutError as exc:
            raise Timeout(f"{exc}: retry later") from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if not fresh:
            return False, entry, b""
        try:
            body = run(entry) or b""
        except SMBError as exc:
            if entry.applied and not getattr(exc, "resumable", False):
                entry.finish(error_status(exc), str(exc).encode())
            else:
                self.interrupt(entry)
            raise
        except BaseException:
            self.interrupt(entry)
            raise
        if not entry.done:   # ``run`` may finish it itself (a mutation served unreplicated)
            entry.finish(Status.OK, body)
        return True, entry, body
