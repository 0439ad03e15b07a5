"""A unary call's cancel scope on asyncio is entered only once its handler suspends
(``Handlers.run``, ``net.backend.OutermostScope``): as the outermost of the handler task's
scopes, even when the handler suspended inside scopes of its own, so a cancel reaches it as
anyio delivers any cancellation -- not into a shielded scope, and at once outside one.

Every test runs on both anyio backends (trio enters the scope first, as asyncio did: the same
tests pin the behaviour) and in both directions.
"""

from __future__ import annotations

from typing import Protocol

import anyio
import pytest
from rpcutil import Direction, Pair, both_directions, open_pair

import garcon_link as gl

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DEADLINE = 10


class Scoped(Protocol):
    async def shielded(self, token: int) -> None: ...
    async def nested(self, token: int) -> None: ...
    async def group(self, token: int) -> None: ...
    async def now(self, token: int) -> int: ...
    async def release(self, token: int) -> None: ...


class ScopedImpl:
    def __init__(self) -> None:
        self.ledger: list[str] = []
        self.gates: dict[int, anyio.Event] = {}
        self.entered: dict[int, anyio.Event] = {}

    def _gate(self, token: int) -> anyio.Event:
        return self.gates.setdefault(token, anyio.Event())

    def _entered(self, token: int) -> anyio.Event:
        return self.entered.setdefault(token, anyio.Event())

    async def shielded(self, token: int) -> None:
        """Suspends first inside a shielded scope of its own, then outside it."""
        try:
            with anyio.CancelScope(shield=True):
                self._entered(token).set()
                await self._gate(token).wait()
                self.ledger.append(f"shielded {token} done")
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.ledger.append(f"cancelled {token}")
            raise

    async def nested(self, token: int) -> None:
        """Suspends first two scopes deep (one with a far deadline), then leaves both and
        suspends again in none of its own."""
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + 60):
                with anyio.CancelScope():
                    self._entered(token).set()
                    await self._gate(token).wait()
            self.ledger.append(f"left {token}")
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.ledger.append(f"cancelled {token}")
            raise

    async def group(self, token: int) -> None:
        """Suspends first waiting for a task group of its own, whose child waits forever."""

        async def child() -> None:
            try:
                self._entered(token).set()
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.ledger.append(f"child cancelled {token}")
                raise

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(child)
        except anyio.get_cancelled_exc_class():
            self.ledger.append(f"cancelled {token}")
            raise

    async def now(self, token: int) -> int:
        return token

    async def release(self, token: int) -> None:
        self._gate(token).set()


def _cancelled(pair: Pair) -> int:
    return int(pair.live_worker.statistics().calls.server.get(("cancelled", "CANCELLED"), 0))


async def _until(impl: ScopedImpl, entry: str) -> None:
    while entry not in impl.ledger:
        await anyio.sleep(0.001)


@both_directions
async def test_a_cancel_waits_for_the_handlers_own_shield(direction: Direction) -> None:
    impl = ScopedImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"scoped": impl}) as pair:
            facade = pair.executor.service("scoped", Scoped)
            async with anyio.create_task_group() as tg:
                tg.start_soon(facade.shielded, 1)
                await impl._entered(1).wait()
                tg.cancel_scope.cancel()  # the caller gives up: the worker is sent a cancel
            # Two round trips after the cancel: the worker has read it and run a loop turn
            # since, so a cancellation delivered into the shield would have landed.
            assert await facade.now(2) == 2
            assert await facade.now(3) == 3
            assert impl.ledger == []
            await facade.release(1)
            await _until(impl, "cancelled 1")
            assert impl.ledger == ["shielded 1 done", "cancelled 1"]
            assert _cancelled(pair) == 1
            assert await facade.now(4) == 4


@both_directions
async def test_a_cancel_reaches_a_handler_inside_its_own_scopes(direction: Direction) -> None:
    impl = ScopedImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"scoped": impl}) as pair:
            facade = pair.executor.service("scoped", Scoped)
            # First without a cancel: the handler leaves its scopes and suspends in the call's.
            async with anyio.create_task_group() as tg:
                tg.start_soon(facade.nested, 1)
                await impl._entered(1).wait()
                await facade.release(1)
                await _until(impl, "left 1")
                tg.cancel_scope.cancel()
            await _until(impl, "cancelled 1")
            # Then cancelled while two scopes deep.
            async with anyio.create_task_group() as tg:
                tg.start_soon(facade.nested, 2)
                await impl._entered(2).wait()
                tg.cancel_scope.cancel()
            await _until(impl, "cancelled 2")
            assert impl.ledger == ["left 1", "cancelled 1", "cancelled 2"]
            assert _cancelled(pair) == 2
            assert await facade.now(3) == 3


@both_directions
async def test_retiring_the_session_cancels_a_handler_inside_its_own_scopes(
    direction: Direction,
) -> None:
    impl = ScopedImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"scoped": impl}) as pair:
            facade = pair.executor.service("scoped", Scoped)
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    with pytest.raises(gl.CallError):
                        await facade.nested(1)

                tg.start_soon(call)
                await impl._entered(1).wait()
                await pair.stop_worker()  # waits for the session's handlers to end
                assert impl.ledger == ["cancelled 1"]


@both_directions
async def test_a_cancel_reaches_the_children_of_the_handlers_task_group(
    direction: Direction,
) -> None:
    impl = ScopedImpl()
    with anyio.fail_after(DEADLINE):
        async with open_pair(direction, {"scoped": impl}) as pair:
            facade = pair.executor.service("scoped", Scoped)
            async with anyio.create_task_group() as tg:
                tg.start_soon(facade.group, 1)
                await impl._entered(1).wait()
                tg.cancel_scope.cancel()
            await _until(impl, "cancelled 1")
            assert impl.ledger == ["child cancelled 1", "cancelled 1"]
            assert _cancelled(pair) == 1
            assert await facade.now(2) == 2
