"""A barrier timeout's counts travel as fields in the call's trailing metadata, beside
its unchanged message, and come back on the client's typed error (no text is parsed)."""
from __future__ import annotations

import grpc

from smb_protocol import errors, rpc, waits


class _Failed(grpc.RpcError):
    """A failed call as the gRPC client library hands it over."""

    def __init__(self, message: str, trailing: tuple[tuple[str, str], ...]) -> None:
        self.message = message
        self.trailing = trailing

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self.message

    def trailing_metadata(self) -> tuple[_Item, ...]:
        return tuple(_Item(k, v) for k, v in self.trailing)


class _Item:
    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value


def _sent(exc: errors.SMBError) -> errors.SMBError:
    """``exc`` as the client sees it after the server aborted a call with it."""
    trailing = ((rpc.ERROR_KEY, errors.wire_class(exc).__name__), *waits.metadata(exc))
    return rpc.translate(_Failed(str(exc), trailing))


def test_the_counts_and_missing_ranks_come_back_as_fields() -> None:
    text = "barrier 'job/x': 2 of 4 parties arrived within 1 s; missing: rank 1, 3"
    got = _sent(errors.BarrierTimeout(text, arrived=2, parties=4, missing=[1, 3]))
    assert type(got) is errors.BarrierTimeout and str(got) == text
    assert (got.arrived, got.parties, got.missing) == (2, 4, [1, 3])


def test_unknown_counts_stay_unknown_and_the_text_is_not_read() -> None:
    got = _sent(errors.BarrierTimeout("barrier 'job/x': 2 of 4 parties arrived; missing: rank 1"))
    assert isinstance(got, errors.BarrierTimeout)
    assert (got.arrived, got.parties, got.missing) == (None, None, None)


def test_no_missing_rank_is_an_empty_list_not_unknown() -> None:
    got = _sent(errors.BarrierTimeout("late", arrived=4, parties=4, missing=[]))
    assert isinstance(got, errors.BarrierTimeout) and got.missing == []


def test_other_errors_carry_no_counts() -> None:
    assert waits.metadata(errors.RegionNotFound("no such region")) == ()
    got = _sent(errors.RegionNotFound("no such region"))
    assert type(got) is errors.RegionNotFound


def test_malformed_counts_are_left_unknown() -> None:
    exc = errors.BarrierTimeout("late")
    waits.read_metadata(exc, [(waits.ARRIVED_KEY, "two"), (waits.MISSING_KEY, "1,x")])
    assert (exc.arrived, exc.missing) == (None, None)


def test_ranks_text_names_the_missing_ranks() -> None:
    assert waits.ranks_text([1, 3]) == "; missing: rank 1, 3"
    assert waits.ranks_text([]) == waits.ranks_text(None) == ""
