"""The error tables are derived from the exception classes: every class survives the
data-plane status byte and a gRPC call, both ways."""
from __future__ import annotations

from collections import namedtuple

import grpc
import pytest

import smb_client
from smb_protocol import errors, rpc

Metadatum = namedtuple("Metadatum", "key value")  # what grpc hands out


class FakeRpcError(grpc.RpcError):
    """What a stub raises: a status code, details, and trailing metadata."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple = ()) -> None:
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._metadata


def all_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(all_subclasses(sub))
    return out


CLASSES = [c for c in all_subclasses(errors.SMBError) if c.__module__ == errors.__name__]


def test_the_tables_hold_every_class_of_the_tree():
    assert set(errors.error_classes()) == set(CLASSES)
    assert len(CLASSES) >= 23
    assert len({c.status for c in CLASSES}) == len(CLASSES)
    assert {c.__name__ for c in CLASSES} <= set(errors.__all__)
    assert all(getattr(smb_client, c.__name__) is c for c in CLASSES)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_wire_status_round_trip(cls):
    status = errors.error_status(cls("boom"))
    assert status is cls.status and 0 < status < 256
    back = errors.status_error(int(status), "boom")
    assert type(back) is cls and str(back) == "boom"
    assert errors.error_class(cls.__name__) is cls


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_grpc_round_trip(cls):
    exc = cls("boom")
    code = rpc.status_code_for(exc)
    assert isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK
    back = rpc.translate(FakeRpcError(code, "boom", (Metadatum(rpc.ERROR_KEY, cls.__name__),)))
    assert type(back) is cls and str(back) == "boom"
    # without the name, the code alone gives a base of the class (or ServerError)
    unnamed = rpc.translate(FakeRpcError(code, "boom"))
    assert isinstance(exc, type(unnamed)) or type(unnamed) is errors.ServerError


def test_codes_without_a_name_map_to_the_most_general_class():
    assert rpc.code_class(grpc.StatusCode.NOT_FOUND) is errors.NotFound
    assert rpc.code_class(grpc.StatusCode.UNAUTHENTICATED) is errors.AuthenticationError
    assert rpc.code_class(grpc.StatusCode.INTERNAL) is errors.ServerError
    assert rpc.code_class(grpc.StatusCode.DATA_LOSS) is errors.ServerError
    unavailable = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down")
    assert type(rpc.translate(unavailable, errors.ControllerUnavailable)) is errors.ControllerUnavailable


def test_foreign_exceptions_travel_as_their_nearest_known_base():
    class Mine(errors.RegionNotFound):
        pass

    assert errors.error_status(Mine()) is errors.Status.REGION_NOT_FOUND
    assert errors.wire_class(ValueError("x")) is errors.ServerError
    assert rpc.status_code_for(KeyError("x")) is grpc.StatusCode.INTERNAL
    assert type(errors.status_error(250, "?")) is errors.ServerError


def test_the_message_limit_is_one_constant():
    from smb_server.runtime import grpc_util

    assert dict(rpc.CHANNEL_OPTIONS)["grpc.max_send_message_length"] == rpc.MAX_MESSAGE_BYTES
    assert ("grpc.max_receive_message_length", rpc.MAX_MESSAGE_BYTES) in rpc.MESSAGE_SIZE_OPTIONS
    assert grpc_util.MESSAGE_SIZE_OPTIONS is rpc.MESSAGE_SIZE_OPTIONS
