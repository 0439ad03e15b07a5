"""Fail fast on refusals a redial will not heal.

A controller that dials with the wrong secret, an executor id the worker does not serve, or the
wrong role learns it from ``wait_ready`` at once -- an ``AuthenticationError`` (or
``HandshakeError``) whose message says what to fix -- instead of a ``TimeoutError`` at the end of
its timeout. The link keeps dialing: once the other end is fixed, the next ``wait_ready``
succeeds (``garcon-link call``'s exit 8 is tested in ``tests/test_cli.py``). Timeouts here are
generous upper bounds: a test fails if the refusal is reported only when the timeout ends.
"""

from __future__ import annotations

import anyio
import pytest

import garcon_link as gl
from garcon_link.testing import free_tcp_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LIMITS = gl.Limits(
    backoff_base=0.01, backoff_max=0.05, handshake_timeout=2.0, takeover_probe_timeout=1.0
)
PATIENT = 30.0  # far longer than a refusal takes: reaching it means nothing failed fast


def config(role: gl.Role, executor_id: str, secret: gl.Secret, **where: object) -> gl.LinkConfig:
    return gl.LinkConfig(
        executor_id=executor_id,
        role=role,
        secret=secret,
        limits=LIMITS,
        **where,  # type: ignore[arg-type]
    )


class Calc:
    async def add(self, a: int, b: int) -> int:
        return a + b


@pytest.mark.parametrize(
    ("worker_id", "controller_id", "same_secret"),
    [("box", "box", False), ("box", "other-box", True)],
    ids=["wrong secret", "wrong executor id"],
)
async def test_a_refused_key_fails_wait_ready_at_once_with_the_fix(
    worker_id: str, controller_id: str, same_secret: bool
) -> None:
    secret = gl.generate_secret()
    other = secret if same_secret else gl.generate_secret()
    worker_config = config(gl.Role.WORKER, worker_id, secret, listen=("127.0.0.1", 0))
    async with gl.Worker(worker_config, {"calc": Calc()}) as worker:
        controller = config(gl.Role.CONTROLLER, controller_id, other, dial=worker.url)
        async with gl.connect(controller) as executor:
            with pytest.raises(gl.AuthenticationError) as caught:
                await executor.wait_ready(PATIENT)
            assert "same secret" in str(caught.value)
            assert "4001" in str(caught.value)
            with pytest.raises(gl.AuthenticationError):  # still refused: asked again, told again
                await executor.wait_ready(PATIENT)


async def test_two_controllers_are_told_their_roles_conflict() -> None:
    secret = gl.generate_secret()
    listening = config(gl.Role.CONTROLLER, "box", secret, listen=("127.0.0.1", 0))
    async with gl.connect(listening) as first:
        dialing = config(gl.Role.CONTROLLER, "box", secret, dial=first.link.url)
        async with gl.connect(dialing) as second:
            with pytest.raises(gl.HandshakeError) as caught:
                await second.wait_ready(PATIENT)
            assert caught.value.reason is gl.errors.HandshakeFailure.ROLE_CONFLICT
            assert 'role = "worker"' in str(caught.value)


async def test_once_the_other_end_is_fixed_the_link_recovers() -> None:
    right, wrong = gl.generate_secret(), gl.generate_secret()
    port = free_tcp_port()
    url = f"ws://127.0.0.1:{port}/executor"
    controller = config(gl.Role.CONTROLLER, "box", right, dial=url)
    async with gl.connect(controller) as executor:
        misconfigured = config(gl.Role.WORKER, "box", wrong, listen=("127.0.0.1", port))
        async with gl.Worker(misconfigured, {"calc": Calc()}):
            with pytest.raises(gl.AuthenticationError):
                await executor.wait_ready(PATIENT)
        fixed = config(gl.Role.WORKER, "box", right, listen=("127.0.0.1", port))
        async with gl.Worker(fixed, {"calc": Calc()}):
            with anyio.fail_after(PATIENT):
                while True:  # bounded: a refusal from the old worker may still be reported once
                    try:
                        await executor.wait_ready(PATIENT)
                        break
                    except gl.AuthenticationError:
                        await anyio.sleep(0.05)
            assert executor.link.refusal is None
            assert await executor.service("calc").add(2, 3) == 5


async def test_a_fleet_dialing_with_a_wrong_key_fails_wait_ready_at_once() -> None:
    secret = gl.generate_secret()
    worker_config = config(gl.Role.WORKER, "box", secret, listen=("127.0.0.1", 0))
    async with gl.Worker(worker_config, {"calc": Calc()}) as worker:
        fleet_config = gl.FleetConfig(
            dial=(gl.DialExecutor("box", worker.url, gl.generate_secret()),), limits=LIMITS
        )
        async with gl.fleet(fleet_config) as fleet:
            with pytest.raises(gl.AuthenticationError, match="same secret"):
                await fleet.executor("box").wait_ready(PATIENT)
