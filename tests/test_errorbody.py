"""Tests of garcon_link.rpc.errorbody: a handler's exception keeps its args across the wire.

The body a worker sends for a handler that raised carries the exception's ``args`` as values
(bounded); the caller re-creates an allow-listed type with them, or with its message and a note
when they could not be sent. No sockets for the body's round trip; one real session for a
registered builtin exception.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import anyio
import cbor2
import pytest
from rpcutil import open_pair

import garcon_link as gl
from garcon_link.rpc.errorbody import (
    MAX_ERROR_ARGS_BYTES,
    error_body,
    error_from_body,
    handler_error,
    local_exception,
)

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture(autouse=True)
def key_error_registered() -> Iterator[None]:
    """KeyError re-raised as itself for each test of this module only: every other test still
    sees a remote KeyError arrive as RemoteError."""
    gl.register_exception(KeyError)
    yield
    assert gl.unregister_exception(KeyError)


def _received(exc: Exception) -> BaseException:
    """What the caller raises for a handler that raised ``exc``: body, CBOR, reading."""
    error, extra = handler_error(exc)
    body = error_body(error.outcome, error.code, error.message, **extra)
    return local_exception(error_from_body(cbor2.loads(cbor2.dumps(body))))


def test_a_registered_builtin_exception_keeps_its_args() -> None:
    received = _received(KeyError("missing-key"))
    assert type(received) is KeyError
    assert received.args == ("missing-key",)
    assert isinstance(received.__cause__, gl.RemoteError)
    assert received.__cause__.remote_args == ("missing-key",)


def test_an_unregistered_type_arrives_as_remote_error_again() -> None:
    assert not gl.unregister_exception(ValueError)  # never registered: nothing changes
    assert gl.unregister_exception(KeyError)
    try:
        received = _received(KeyError("k"))
        assert type(received) is gl.RemoteError
        assert received.remote_type == "builtins.KeyError"
        assert not gl.unregister_exception(KeyError)
    finally:
        gl.register_exception(KeyError)  # what the fixture undoes


def test_a_namesake_class_does_not_unregister_the_registered_one() -> None:
    namesake = type("KeyError", (Exception,), {"__module__": "builtins"})
    assert not gl.unregister_exception(namesake)
    assert type(_received(KeyError("k"))) is KeyError


def test_args_are_values() -> None:
    received = _received(KeyError("k", 3, b"\x00", None, {"a": [1.5]}))
    assert received.args == ("k", 3, b"\x00", None, {"a": [1.5]})
    # A tuple travels as an array.
    assert _received(KeyError(("a", 1))).args == (["a", 1],)
    assert _received(KeyError()).args == ()


def test_args_that_do_not_encode_fall_back_to_the_message_with_a_note() -> None:
    received = _received(KeyError(object()))
    assert type(received) is KeyError
    assert len(received.args) == 1 and received.args[0].startswith("<object object at")
    assert any("do not encode" in note for note in received.__notes__)


def test_args_over_the_bound_are_not_sent() -> None:
    error, extra = handler_error(KeyError("x" * (MAX_ERROR_ARGS_BYTES + 1)))
    assert "args" not in extra
    assert f"over {MAX_ERROR_ARGS_BYTES}" in extra["args_note"]
    body = error_body(error.outcome, error.code, error.message, **extra)
    assert len(cbor2.dumps(body)) < 3 * MAX_ERROR_ARGS_BYTES + 1000  # message, traceback, note
    received = local_exception(error_from_body(body))
    assert type(received) is KeyError
    assert any(f"over {MAX_ERROR_ARGS_BYTES}" in note for note in received.__notes__)


@gl.register_exception
class Strict(Exception):
    """Takes one text argument, nothing else."""

    def __init__(self, message: str) -> None:
        if not isinstance(message, str):
            raise TypeError("a text message")
        super().__init__(message)


def test_a_class_that_refuses_the_args_gets_the_message() -> None:
    error, extra = handler_error(Strict("m"))
    body = error_body(error.outcome, error.code, error.message, **extra)
    assert local_exception(error_from_body(body)).args == ("m",)
    body["args"] = [1, 2]  # not what Strict takes
    received = local_exception(error_from_body(body))
    assert type(received) is Strict
    assert received.args == ("m",)
    assert any("refused the remote arguments" in note for note in received.__notes__)


def test_a_peer_without_args_is_read_as_before() -> None:
    body = error_body(gl.Outcome.FAILED, "HANDLER_FAILED", "'k'", remote_type="builtins.KeyError")
    received = local_exception(error_from_body(body))
    assert type(received) is KeyError and received.args == ("'k'",)
    assert not getattr(received, "__notes__", [])


@pytest.mark.parametrize("field", [{"args": "no"}, {"args_note": 3}])
def test_mistyped_args_fields_make_the_body_unreadable(field: dict[str, Any]) -> None:
    body = error_body(gl.Outcome.FAILED, "HANDLER_FAILED", "m", remote_type="builtins.KeyError")
    body.update(field)
    error = error_from_body(body)
    assert isinstance(error, gl.OutcomeUnknown) and error.code == "MALFORMED_ERROR"


class Store(Protocol):
    async def get(self, key: str) -> str: ...


class StoreImpl:
    async def get(self, key: str) -> str:
        raise KeyError(key)


@pytest.mark.anyio
async def test_a_remote_key_error_is_raised_with_its_key() -> None:
    with anyio.fail_after(10):
        async with open_pair("worker-listens", {"store": gl.Service(StoreImpl(), Store)}) as pair:
            store = pair.executor.service("store", Store)
            with pytest.raises(KeyError) as info:
                await store.get("missing-key")
            assert info.value.args == ("missing-key",)
            assert str(info.value) == "'missing-key'"
