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
"""
from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from smb_protocol.errors import InvalidArgument, SMBError, Status, Timeout, error_status

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


@dataclass(slots=True)
class Entry:
    """One request's state: running (``done`` False, ``owned`` True), interrupted
    (both False; ``applied`` bytes took effect) or finished (``status``, ``body``)."""
    owned: bool = True
    done: bool = False
    what: tuple[int, ...] = ()
    applied: int = 0
    status: int = 0
    body: bytes = b""
    _table: DedupTable | None = field(default=None, repr=False, compare=False)

    def finish(self, status: int = 0, body: bytes = b"") -> None:
        assert self._table is not None
        self._table._finish(self, status, body)


class DedupTable:
    def __init__(self, window: int = WINDOW, max_clients: int = MAX_CLIENTS) -> None:
        if window < 1 or max_clients < 1:
            raise ValueError("window and max_clients must be positive")
        self.window = window
        self.max_clients = max_clients
        self._clients: OrderedDict[int, OrderedDict[int, Entry]] = OrderedDict()
        self._cond = threading.Condition()
        self._waiting = 0   # callers waiting on _cond for another attempt (notified only then)

    def begin(self, client: int, seq: int, timeout: float | None = None,
              what: tuple[int, ...] = ()) -> tuple[bool, Entry]:
        """``(True, entry)``: the caller runs the request (resuming after
        ``entry.applied`` bytes) and must end it with ``entry.finish`` or
        :meth:`interrupt`. ``(False, entry)``: already finished; answer
        ``entry.status``/``entry.body``. Waits while another attempt runs; raises
        TimeoutError after ``timeout`` seconds of waiting. ``what`` describes the request
        (operation, extent, range): a number reused for a different request raises
        ValueError instead of answering for the wrong one."""
        with self._cond:
            while True:
                seen = self._entries(client)
                self._clients.move_to_end(client)
                entry = seen.get(seq)
                if entry is None:
                    entry = seen[seq] = Entry(what=what, _table=self)
                    self._trim(seen)
                    return True, entry
                if entry.what != what:
                    raise ValueError(f"request {seq} of client {client:#x} was {entry.what}, "
                                     f"now {what}: a sequence number names one request")
                if entry.done:
                    return False, entry
                if not entry.owned:
                    entry.owned = True
                    return True, entry
                self._waiting += 1
                try:
                    woken = self._cond.wait(timeout)
                finally:
                    self._waiting -= 1
                if not woken:
                    raise TimeoutError(f"request {seq} of client {client:#x} is still running")

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

    def interrupt(self, entry: Entry) -> None:
        """The attempt stopped part way (``entry.applied`` bytes in effect): a retry resumes it."""
        with self._cond:
            entry.owned = False
            if self._waiting:
                self._cond.notify_all()

    def _finish(self, entry: Entry, status: int, body: bytes) -> None:
        with self._cond:
            entry.status, entry.body, entry.done, entry.owned = status, body, True, False
            if self._waiting:
                self._cond.notify_all()

    def _entries(self, client: int) -> OrderedDict[int, Entry]:
        """The entries of ``client``, made empty for a new one (forgetting the least
        recently seen client beyond ``max_clients``). Under ``_cond``."""
        seen = self._clients.get(client)
        if seen is None:
            seen = self._clients[client] = OrderedDict()
            while len(self._clients) > self.max_clients:
                self._clients.popitem(last=False)
        return seen

    def _trim(self, seen: OrderedDict[int, Entry]) -> None:
        """Forget the oldest finished entries beyond the window (running ones are kept).
        Looks from the oldest on and stops once it found enough: one or a few entries
        per request, not the whole window (this runs under the table's lock)."""
        extra = len(seen) - self.window
        if extra <= 0:
            return
        doomed = []
        for seq, e in seen.items():
            if e.done:
                doomed.append(seq)
                if len(doomed) == extra:
                    break
        for seq in doomed:
            del seen[seq]

    def export(self, extent_id: int) -> list[Record]:
        """The entries of requests on ``extent_id`` that took effect (finished, or
        interrupted after some bytes), to hand to a copy of the extent filled from this
        server's bytes (:meth:`seed`)."""
        with self._cond:
            return [(client, seq, e.what, e.applied, e.done, e.status, e.body)
                    for client, seen in self._clients.items() for seq, e in seen.items()
                    if len(e.what) == 5 and e.what[1] == extent_id
                    and (e.done or (e.applied and not e.owned))]

    def forget(self, extent_id: int) -> int:
        """Drop the entries of requests on ``extent_id`` (a copy whose bytes a sync
        replaces: the primary hands over its own entries at the end). A piece still
        running is of an older view, which its next chunk finds (it stops there), so its
        entry goes too. Returns how many were dropped."""
        with self._cond:
            dropped = 0
            for seen in self._clients.values():
                doomed = [seq for seq, e in seen.items() if len(e.what) == 5 and e.what[1] == extent_id]
                for seq in doomed:
                    del seen[seq]
                dropped += len(doomed)
            return dropped

    def seed(self, records: Iterable[Record]) -> int:
        """Take entries handed over by a primary: each one this table does not have yet
        (an entry it has came from a forwarded piece of the same request and is as new),
        finished or interrupted as it was there. Returns how many were taken."""
        taken = 0
        with self._cond:
            for client, seq, what, applied, done, status, body in records:
                seen = self._entries(client)
                if seq in seen:
                    continue
                seen[seq] = Entry(owned=False, done=done, what=tuple(what), applied=applied,
                                  status=status, body=body, _table=self)
                self._trim(seen)
                taken += 1
            self._cond.notify_all()
        return taken

    def __len__(self) -> int:
        with self._cond:
            return sum(len(s) for s in self._clients.values())
