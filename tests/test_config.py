"""Tests of garcon_link.settings.config, .fleet and .tls: loading, refusals, secrets, TLS."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import ssl
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import trustme

from garcon_link.core.wire import Role
from garcon_link.errors import ConfigError
from garcon_link.limits import Limits
from garcon_link.settings.callers import load_gateway_config
from garcon_link.settings.config import CONFIG_ENV_VAR, MAX_CONFIG_BYTES, LinkConfig, load_config
from garcon_link.settings.fleet import DialExecutor, FleetConfig, load_fleet_config
from garcon_link.settings.secrets import (
    MIN_SECRET_BYTES,
    Secret,
    generate_secret,
    read_secret_file,
    write_secret_file,
)
from garcon_link.settings.tls import TlsConfig

POSIX = os.name == "posix"
posix_only = pytest.mark.skipif(not POSIX, reason="file modes are only checked on POSIX")

# A recognizable secret (not hex, so it is used as UTF-8 bytes); no text the library produces may
# contain it or its hex form.
SECRET_TEXT = "CANARY-secret-do-not-leak-7f3a9c-0123456789"
SECRET = Secret(SECRET_TEXT.encode())
LEAK_MARKERS = (SECRET_TEXT, SECRET_TEXT.encode().hex(), "CANARY")

LISTEN_BODY = """
executor_id = "build-box-1"
role = "worker"
secret_file = "link.secret"

[connection]
listen = "127.0.0.1:8765"
"""


def assert_no_leak(*texts: str) -> None:
    for text in texts:
        for marker in LEAK_MARKERS:
            assert marker not in text


def refused(fn: Callable[[], object], *fragments: str) -> ConfigError:
    """Run ``fn``; it must raise ConfigError naming every fragment and leaking nothing."""
    with pytest.raises(ConfigError) as info:
        fn()
    exc = info.value
    message = str(exc)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert_no_leak(message, repr(exc))
    cause = exc.__cause__
    while cause is not None:
        assert_no_leak(str(cause), repr(cause))
        cause = cause.__cause__
    return exc


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)
    return path


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    return write(tmp_path / "link.secret", SECRET_TEXT + "\n")


def config_file(tmp_path: Path, body: str, *, mode: int = 0o600, name: str = "link.toml") -> Path:
    return write(tmp_path / name, body, mode)


def body_with(connection: str, extra: str = "", *, head: str = "") -> str:
    return (
        f'executor_id = "build-box-1"\nrole = "worker"\nsecret_file = "link.secret"\n{head}\n'
        f"[connection]\n{connection}\n{extra}"
    )


def make(**overrides: object) -> LinkConfig:
    fields: dict[str, object] = {
        "executor_id": "box",
        "role": Role.WORKER,
        "secret": SECRET,
        "listen": ("127.0.0.1", 8765),
    }
    fields.update(overrides)
    return LinkConfig(**fields)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- round trips


def test_listen_config_loads(
    tmp_path: Path, secret_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = config_file(tmp_path, LISTEN_BODY)
    with caplog.at_level(logging.DEBUG):
        config = load_config(path)
    assert config.executor_id == "build-box-1"
    assert config.role is Role.WORKER
    assert config.secret == SECRET
    assert config.secret.reveal() == SECRET_TEXT.encode()
    assert config.listen == ("127.0.0.1", 8765)
    assert config.dial is None
    assert not config.is_dialer
    assert config.listen_url == "ws://127.0.0.1:8765/executor"
    assert config.allow_insecure_development is False
    assert config.tls is None
    assert config.limits == Limits()
    assert config.source == path
    assert config.ssl_context() is None
    assert_no_leak(repr(config), str(config), caplog.text)
    assert "Secret(<redacted, 43 bytes>)" in repr(config)


def test_dial_config_loads(tmp_path: Path, secret_file: Path) -> None:
    body = body_with('dial = "wss://build-box-1.example/executor"').replace("worker", "controller")
    config = load_config(config_file(tmp_path, body))
    assert config.role is Role.CONTROLLER
    assert config.is_dialer
    assert config.dial == "wss://build-box-1.example/executor"
    assert (config.dial_host, config.dial_port, config.dial_tls) == (
        "build-box-1.example",
        443,
        True,
    )
    assert config.listen is None
    assert_no_leak(repr(config))


@pytest.mark.parametrize(
    ("url", "host", "port", "tls"),
    [
        ("ws://127.0.0.1:9000/executor", "127.0.0.1", 9000, False),
        ("ws://localhost/executor", "localhost", 80, False),
        ("ws://127.8.9.10:1/executor", "127.8.9.10", 1, False),
        ("ws://[::1]:8765/executor", "::1", 8765, False),
        ("wss://[2001:db8::1]:8443/executor", "2001:db8::1", 8443, True),
        ("wss://10.0.0.1/executor", "10.0.0.1", 443, True),
    ],
)
def test_dial_url_parts(url: str, host: str, port: int, tls: bool) -> None:
    config = make(listen=None, dial=url)
    assert (config.dial_host, config.dial_port, config.dial_tls) == (host, port, tls)


def test_relative_secret_file_resolves_against_config_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "keys" / "worker.secret", SECRET_TEXT)
    body = LISTEN_BODY.replace('"link.secret"', '"../keys/worker.secret"')
    path = config_file(tmp_path / "conf", body)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config(path).secret == SECRET
    # A relative config path is made absolute against the working directory.
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("conf") / "link.toml")
    assert config.source == tmp_path / "conf" / "link.toml"
    assert config.secret == SECRET


def test_absolute_secret_file(tmp_path: Path) -> None:
    secret = write(tmp_path / "elsewhere" / "s", SECRET_TEXT)
    body = LISTEN_BODY.replace('"link.secret"', f'"{secret.as_posix()}"')
    assert load_config(config_file(tmp_path / "conf", body)).secret == SECRET


def test_hex_secret_is_decoded(tmp_path: Path) -> None:
    raw = bytes(range(32))
    write(tmp_path / "link.secret", "  " + raw.hex().upper() + "\n\n")
    assert load_config(config_file(tmp_path, LISTEN_BODY)).secret.reveal() == raw


def test_inline_secret(tmp_path: Path) -> None:
    body = LISTEN_BODY.replace('secret_file = "link.secret"', f'secret = "{SECRET_TEXT}"')
    config = load_config(config_file(tmp_path, body))
    assert config.secret == SECRET
    assert_no_leak(repr(config))


def test_env_var_names_the_config(
    tmp_path: Path, secret_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = config_file(tmp_path, LISTEN_BODY)
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    assert load_config().source == path


def test_env_var_unset_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    refused(load_config, CONFIG_ENV_VAR, "not set", "load_config(")


def test_limits_overrides(tmp_path: Path, secret_file: Path) -> None:
    extra = (
        "[limits]\nheartbeat_interval = 1\nheartbeat_timeout = 3.5\nmax_frame_bytes = 16384\n"
        "dispatch_deadline = 0\n"
    )
    limits = load_config(config_file(tmp_path, LISTEN_BODY + extra)).limits
    assert limits == Limits(
        heartbeat_interval=1.0, heartbeat_timeout=3.5, max_frame_bytes=16384, dispatch_deadline=0.0
    )
    assert isinstance(limits.heartbeat_interval, float)


def test_unknown_limit_key_refused(tmp_path: Path, secret_file: Path) -> None:
    path = config_file(tmp_path, LISTEN_BODY + "[limits]\nheartbeat_intervall = 1\n")
    refused(lambda: load_config(path), str(path), "heartbeat_intervall", "heartbeat_interval")


def test_empty_limits_table(tmp_path: Path, secret_file: Path) -> None:
    assert load_config(config_file(tmp_path, LISTEN_BODY + "[limits]\n")).limits == Limits()


def test_invalid_limit_value_refused(tmp_path: Path, secret_file: Path) -> None:
    path = config_file(tmp_path, LISTEN_BODY + "[limits]\nheartbeat_timeout = 1\n")
    refused(lambda: load_config(path), str(path), "[limits]", "heartbeat_timeout")
    path = config_file(tmp_path, LISTEN_BODY + '[limits]\nmax_frame_bytes = "big"\n')
    refused(lambda: load_config(path), str(path), "[limits] max_frame_bytes", "a number")
    # Admission, a takeover probe included, runs under the handshake deadline.
    path = config_file(tmp_path, LISTEN_BODY + "[limits]\nhandshake_timeout = 2\n")
    refused(lambda: load_config(path), str(path), "takeover_probe_timeout", "handshake_timeout")


DURATIONS = [
    f.name for f in dataclasses.fields(Limits) if f.type == "float" and "unit" not in f.metadata
]


@pytest.mark.parametrize("name", DURATIONS)
def test_every_duration_has_a_documented_upper_bound_refused_at_load(
    tmp_path: Path, secret_file: Path, name: str
) -> None:
    """A duration too long to mean anything but "never" (1e300 s) is refused at load with one
    line naming the key and the bound, which the key's documentation states."""
    field = next(f for f in dataclasses.fields(Limits) if f.name == name)
    high = field.metadata["max"]
    assert "At most " in Limits.describe()[name]
    assert high <= 30 * 86400 and high >= field.default
    path = config_file(tmp_path, LISTEN_BODY + f"[limits]\n{name} = 1e300\n")
    exc = refused(lambda: load_config(path), str(path), f"Limits.{name} must be at most")
    assert "\n" not in str(exc)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("max_controllers = 0", "must be > 0"),
        ("max_controllers = -3", "must be > 0"),
        ("max_controllers = 2.5", "must be an integer"),
        ("max_controllers = 99999999999999999", "must be at most 4096"),
    ],
)
def test_a_careless_max_controllers_is_refused(
    tmp_path: Path, secret_file: Path, line: str, problem: str
) -> None:
    # Each controller's place also widens the authenticated-socket cap: it is bounded.
    path = config_file(tmp_path, LISTEN_BODY + f"[limits]\n{line}\n")
    refused(lambda: load_config(path), str(path), "Limits.max_controllers", problem)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
def test_a_config_path_that_is_no_regular_file_is_refused_without_reading(tmp_path: Path) -> None:
    # A FIFO would block the loader until a writer came; /dev/zero would never end.
    fifo = tmp_path / "link.toml"
    os.mkfifo(fifo)
    for loader in (load_config, load_fleet_config, load_gateway_config):
        refused(lambda: loader(fifo), str(fifo), "not a regular file")  # noqa: B023
    if os.path.exists("/dev/zero"):
        refused(lambda: load_config("/dev/zero"), "/dev/zero", "not a regular file")


def test_a_config_file_past_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "link.toml"
    with open(path, "wb") as file:
        file.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing is written
    refused(lambda: load_config(path), str(path), f"larger than {MAX_CONFIG_BYTES} bytes")


def test_state_dir_is_a_worker_s_path_relative_to_the_file(
    tmp_path: Path, secret_file: Path
) -> None:
    path = config_file(tmp_path, body_with('listen = "127.0.0.1:8765"', head='state_dir = "st"'))
    assert load_config(path).state_dir == tmp_path / "st"
    assert load_config(config_file(tmp_path, LISTEN_BODY)).state_dir is None
    path = config_file(tmp_path, body_with('listen = "127.0.0.1:8765"', head="state_dir = 3"))
    refused(lambda: load_config(path), str(path), "state_dir", "expected a string")
    path = config_file(tmp_path, body_with('listen = "127.0.0.1:8765"', head='state_dir = ""'))
    refused(lambda: load_config(path), str(path), "state_dir", "the path is empty")
    assert make(state_dir="st").state_dir == Path("st")
    refused(lambda: make(state_dir=3), "state_dir", "expected a path")
    refused(
        lambda: make(
            role=Role.CONTROLLER, listen=None, dial="ws://127.0.0.1:1/executor", state_dir="s"
        ),
        "state_dir",
        "only a worker keeps a state directory",
    )


def test_ipv6_listen(tmp_path: Path, secret_file: Path) -> None:
    body = body_with('listen = "[::1]:8765"')
    config = load_config(config_file(tmp_path, body))
    assert config.listen == ("::1", 8765)
    assert config.listen_url == "ws://[::1]:8765/executor"
    path = config_file(tmp_path, body_with('listen = "[::]:0"'))
    refused(lambda: load_config(path), str(path), "[connection] listen", "'::'", "allow_insecure")
    allowed = body_with('listen = "[::]:0"', head="allow_insecure_development = true")
    assert load_config(config_file(tmp_path, allowed)).listen == ("::", 0)


def test_plain_text_off_loopback_allowed_for_development(tmp_path: Path, secret_file: Path) -> None:
    head = "allow_insecure_development = true"
    config = load_config(
        config_file(tmp_path, body_with('dial = "ws://10.1.2.3:8765/executor"', head=head))
    )
    assert config.allow_insecure_development
    assert (config.dial_host, config.dial_tls) == ("10.1.2.3", False)
    config = load_config(config_file(tmp_path, body_with('listen = "0.0.0.0:8765"', head=head)))
    assert config.listen == ("0.0.0.0", 8765)


def test_wss_and_tls_listen_off_loopback_need_nothing_extra(
    tmp_path: Path, secret_file: Path
) -> None:
    config = load_config(config_file(tmp_path, body_with('dial = "wss://10.1.2.3/executor"')))
    assert config.dial_tls
    tls = '[tls]\ncert = "server.pem"\nkey = "server.key"\nca = "/abs/ca.pem"\n'
    config = load_config(config_file(tmp_path, body_with('listen = "0.0.0.0:8765"', tls)))
    assert config.tls == TlsConfig(
        tmp_path / "server.pem", tmp_path / "server.key", Path("/abs/ca.pem")
    )
    assert config.listen_url == "wss://0.0.0.0:8765/executor"


@posix_only
def test_world_readable_config_without_inline_secret_is_fine(
    tmp_path: Path, secret_file: Path
) -> None:
    assert load_config(config_file(tmp_path, LISTEN_BODY, mode=0o644)).secret == SECRET


# --------------------------------------------------------------------------- refusals


def test_missing_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    refused(lambda: load_config(path), str(path), "not found")


def test_directory_refused(tmp_path: Path) -> None:
    refused(lambda: load_config(tmp_path), str(tmp_path), "cannot read")


def test_toml_syntax_error_names_the_line(tmp_path: Path, secret_file: Path) -> None:
    path = config_file(tmp_path, LISTEN_BODY + "\nbroken = = 1\n")
    refused(lambda: load_config(path), str(path), "TOML syntax error", "line 9", "column")


def test_non_utf8_refused(tmp_path: Path) -> None:
    path = tmp_path / "link.toml"
    path.write_bytes(b'executor_id = "\xff"\n')
    refused(lambda: load_config(path), str(path), "UTF-8")


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        pytest.param(
            LISTEN_BODY.replace('executor_id = "build-box-1"', ""),
            ["executor_id", "missing", 'executor_id = "'],
            id="missing-executor-id",
        ),
        pytest.param(
            LISTEN_BODY.replace('role = "worker"', ""),
            ["role", "missing", 'role = "worker"'],
            id="missing-role",
        ),
        pytest.param(
            LISTEN_BODY.replace('"worker"', '"boss"'),
            ["role", "'boss'", "worker or controller"],
            id="bad-role",
        ),
        pytest.param(
            LISTEN_BODY.replace('"build-box-1"', '"build box"'),
            ["executor_id", "whitespace"],
            id="executor-id-whitespace",
        ),
        pytest.param(
            LISTEN_BODY.replace('"build-box-1"', '""'),
            ["executor_id", "1-200 characters"],
            id="executor-id-empty",
        ),
        pytest.param(
            LISTEN_BODY.replace('"build-box-1"', '"' + "x" * 201 + '"'),
            ["executor_id", "1-200 characters", "201"],
            id="executor-id-too-long",
        ),
        pytest.param(
            LISTEN_BODY.replace('"build-box-1"', "12"),
            ["executor_id", "expected a string, got an integer"],
            id="executor-id-type",
        ),
        pytest.param(
            'allow_insecure_development = "yes"\n' + LISTEN_BODY,
            ["allow_insecure_development", "expected a boolean, got a string", "true or false"],
            id="insecure-flag-type",
        ),
        pytest.param(
            "colour = 1\n" + LISTEN_BODY,
            ["colour", "unknown key", "allowed keys", "executor_id", "secret_file"],
            id="unknown-top-level-key",
        ),
        pytest.param(
            LISTEN_BODY + "port = 1\n",
            ["[connection] port", "unknown key", "listen, dial"],
            id="unknown-connection-key",
        ),
        pytest.param(
            "secret_flie = 1\n" + LISTEN_BODY,
            ["secret_flie", "unknown key", "did you mean 'secret_file'?", "allowed keys"],
            id="misspelt-top-level-key",
        ),
        pytest.param(
            LISTEN_BODY + "call_timout = 5\n",  # below [connection]: in that table
            ["[connection] call_timout", "'call_timeout' is a [limits] field: move it under"],
            id="limits-field-in-connection",
        ),
        pytest.param(
            LISTEN_BODY + 'state_dir = "state"\n',  # below [connection]: in that table
            ["[connection] state_dir", "'state_dir' is a top-level key: move it above the first"],
            id="top-level-key-in-connection",
        ),
        pytest.param(
            LISTEN_BODY + "[limits]\nallow_insecure_development = true\n",
            ["[limits] allow_insecure_development", "is a top-level key: move it above"],
            id="top-level-key-in-limits",
        ),
        pytest.param(
            LISTEN_BODY + '[tls]\ncert = "a"\nsecret_file = "b"\n',
            ["[tls] secret_file", "'secret_file' is a top-level key"],
            id="top-level-key-in-tls",
        ),
        pytest.param(
            LISTEN_BODY + "[limits]\nheartbeat_intervall = 3\n",
            ["[limits] heartbeat_intervall", "did you mean 'heartbeat_interval'?"],
            id="misspelt-limits-field",
        ),
        pytest.param(
            LISTEN_BODY + '[tls]\ncert = "a"\nkeyfile = "b"\n',
            ["[tls] keyfile", "unknown key", "cert, key, ca"],
            id="unknown-tls-key",
        ),
        pytest.param(
            LISTEN_BODY.replace("[connection]", "[connection.extra]"),
            ["[connection] extra", "unknown key"],
            id="unknown-connection-subtable",
        ),
        pytest.param(
            LISTEN_BODY.replace('listen = "127.0.0.1:8765"', ""),
            ["[connection]", "exactly one of listen and dial"],
            id="neither-listen-nor-dial",
        ),
        pytest.param(
            LISTEN_BODY + 'dial = "wss://h/executor"\n',
            ["[connection]", "exactly one of listen and dial"],
            id="both-listen-and-dial",
        ),
        pytest.param(
            LISTEN_BODY.split("[connection]")[0],
            ["[connection]", "missing", "listen ="],
            id="missing-connection",
        ),
        pytest.param(
            LISTEN_BODY.split("[connection]")[0] + 'connection = "127.0.0.1:1"\n',
            ["[connection]", "expected a table, got a string"],
            id="connection-type",
        ),
        pytest.param(
            body_with("listen = 8765"),
            ["[connection] listen", "expected a string, got an integer"],
            id="listen-type",
        ),
        pytest.param(
            body_with('listen = "::1:8765"'),
            ["[connection] listen", "IPv6 address must be in brackets", "[::1]:8765"],
            id="listen-unbracketed-ipv6",
        ),
        pytest.param(
            body_with('listen = "[example.com]:80"'),
            ["[connection] listen", "bracketed host must be an IPv6 address"],
            id="listen-bracketed-name",
        ),
        pytest.param(
            body_with('listen = "127.0.0.1"'),
            ["[connection] listen", "port is missing"],
            id="listen-no-port",
        ),
        pytest.param(
            body_with('listen = "[::1]"'),
            ["[connection] listen", "port is missing"],
            id="listen-ipv6-no-port",
        ),
        pytest.param(
            body_with('listen = "127.0.0.1:70000"'),
            ["[connection] listen", "70000", "0-65535"],
            id="listen-port-range",
        ),
        pytest.param(
            body_with('listen = "127.0.0.1:http"'),
            ["[connection] listen", "'http'", "0-65535"],
            id="listen-port-name",
        ),
        pytest.param(
            body_with('listen = ":8765"'),
            ["[connection] listen", "host is empty"],
            id="listen-empty-host",
        ),
        pytest.param(
            body_with('listen = "bad_host!:8765"'),
            ["[connection] listen", "neither an IP address nor a valid host name"],
            id="listen-bad-host",
        ),
        pytest.param(
            body_with('listen = "0.0.0.0:8765"'),
            ["[connection] listen", "'0.0.0.0'", "plain text", "[tls]", "allow_insecure"],
            id="listen-plain-off-loopback",
        ),
        pytest.param(
            body_with('listen = "myhost.lan:8765"'),
            ["[connection] listen", "'myhost.lan'", "allow_insecure_development = true"],
            id="listen-plain-hostname",
        ),
        pytest.param(
            body_with('listen = "0.0.0.0:8765"', '[tls]\nca = "ca.pem"\n'),
            ["[tls] cert", "needs a certificate"],
            id="listen-tls-without-cert",
        ),
        pytest.param(
            body_with('dial = "wss://user:pw@h.example/executor"'),
            ["[connection] dial", "userinfo", "remove it"],
            id="dial-userinfo",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor?x=1"'),
            ["[connection] dial", "query"],
            id="dial-query",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor?"'),
            ["[connection] dial", "query"],
            id="dial-empty-query",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor#top"'),
            ["[connection] dial", "fragment"],
            id="dial-fragment",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor/"'),
            ["[connection] dial", "'/executor/'", "end the URL with /executor"],
            id="dial-trailing-slash",
        ),
        pytest.param(
            body_with('dial = "wss://h.example"'),
            ["[connection] dial", "'(empty)'", "/executor"],
            id="dial-no-path",
        ),
        pytest.param(
            body_with('dial = "https://h.example/executor"'),
            ["[connection] dial", "'https'", "not ws or wss"],
            id="dial-https",
        ),
        pytest.param(
            body_with('dial = "h.example:443/executor"'),
            ["[connection] dial", "not ws or wss"],
            id="dial-no-scheme",
        ),
        pytest.param(
            body_with('dial = "wss:///executor"'),
            ["[connection] dial", "host is empty"],
            id="dial-no-host",
        ),
        pytest.param(
            body_with('dial = "wss://h.example:99999/executor"'),
            ["[connection] dial", "port"],
            id="dial-port-range",
        ),
        pytest.param(
            body_with('dial = "wss://h.example:0/executor"'),
            ["[connection] dial", "port"],
            id="dial-port-zero",
        ),
        pytest.param(
            body_with('dial = "wss://h.example:x/executor"'),
            ["[connection] dial", "port"],
            id="dial-port-text",
        ),
        pytest.param(
            body_with('dial = "wss://h example/executor"'),
            ["[connection] dial", "whitespace"],
            id="dial-whitespace",
        ),
        pytest.param(
            body_with('dial = "ws://10.0.0.1:8765/executor"'),
            ["[connection] dial", "plain-text ws://", "'10.0.0.1'", "wss://", "allow_insecure"],
            id="dial-plain-off-loopback",
        ),
        pytest.param(
            body_with('dial = "ws://localhost.example/executor"'),
            ["[connection] dial", "'localhost.example'"],
            id="dial-plain-hostname",
        ),
        pytest.param(
            body_with('dial = "ws://127.0.0.1/executor"', '[tls]\nca = "ca.pem"\n'),
            ["[tls]", "plain ws://", "dial wss://"],
            id="tls-with-ws-dial",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor"', '[tls]\nkey = "k.pem"\n'),
            ["[tls] key", "without a cert"],
            id="tls-key-without-cert",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor"', "[tls]\nca = 1\n"),
            ["[tls] ca", "expected a string"],
            id="tls-type",
        ),
        pytest.param(
            body_with('dial = "wss://h.example/executor"', '[tls]\nca = ""\n'),
            ["[tls] ca", "path is empty"],
            id="tls-empty-path",
        ),
        pytest.param(
            LISTEN_BODY.replace("[connection]", "limits = 3\n[connection]"),
            ["[limits]", "expected a table, got an integer"],
            id="limits-type",
        ),
    ],
)
def test_refusals(tmp_path: Path, secret_file: Path, body: str, fragments: list[str]) -> None:
    path = config_file(tmp_path, body)
    refused(lambda: load_config(path), str(path), *fragments)


@pytest.mark.parametrize(
    ("secret_lines", "fragments"),
    [
        pytest.param("", ["secret / secret_file", "neither is set", "keygen"], id="neither"),
        pytest.param(
            f'secret_file = "link.secret"\nsecret = "{SECRET_TEXT}"',
            ["secret / secret_file", "both are set"],
            id="both",
        ),
        pytest.param('secret = "short"', ["secret", "5 bytes", "at least 32"], id="inline-short"),
        pytest.param('secret = ""', ["secret", "0 bytes", "at least 32"], id="inline-empty"),
        pytest.param("secret = 12345", ["secret", "expected a string, got an integer"], id="type"),
        pytest.param(
            "secret_file = 1", ["secret_file", "expected a string, got an integer"], id="file-type"
        ),
        pytest.param('secret_file = ""', ["secret_file", "path is empty"], id="file-empty-path"),
        pytest.param(
            'secret_file = "missing.secret"',
            ["secret_file", "missing.secret", "does not exist", "keygen"],
            id="file-missing",
        ),
        pytest.param('secret_file = "."', ["secret_file", "not a regular file"], id="file-dir"),
    ],
)
def test_secret_refusals(
    tmp_path: Path, secret_file: Path, secret_lines: str, fragments: list[str]
) -> None:
    body = LISTEN_BODY.replace('secret_file = "link.secret"', secret_lines)
    path = config_file(tmp_path, body)
    refused(lambda: load_config(path), str(path), *fragments)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("too short\n", id="short-text"),
        pytest.param("ab" * 15 + "c\n", id="31-bytes"),
        pytest.param("", id="empty"),
    ],
)
def test_short_secret_file_refused(tmp_path: Path, content: str) -> None:
    secret = write(tmp_path / "link.secret", content)
    path = config_file(tmp_path, LISTEN_BODY)
    refused(lambda: load_config(path), str(path), "secret_file", str(secret), "at least 32")


def test_huge_secret_file_refused(tmp_path: Path) -> None:
    write(tmp_path / "link.secret", "x" * 100_000)
    path = config_file(tmp_path, LISTEN_BODY)
    refused(lambda: load_config(path), str(path), "secret_file", "larger than")


@posix_only
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o601])
def test_group_or_world_accessible_secret_file_refused(tmp_path: Path, mode: int) -> None:
    secret = write(tmp_path / "link.secret", SECRET_TEXT, mode)
    path = config_file(tmp_path, LISTEN_BODY)
    refused(lambda: load_config(path), str(path), "secret_file", f"chmod 600 {secret}")
    refused(lambda: read_secret_file(secret), f"chmod 600 {secret}")


@posix_only
def test_an_empty_secret_file_open_to_others_is_refused_for_its_mode(tmp_path: Path) -> None:
    # The mode is checked before the content: the message says what the file is for, not that
    # it holds a secret (it holds nothing yet).
    secret = write(tmp_path / "link.secret", "", 0o644)
    path = config_file(tmp_path, LISTEN_BODY)
    refused(lambda: load_config(path), str(path), "is for a secret", "0644", f"chmod 600 {secret}")


@posix_only
def test_config_with_inline_secret_must_be_private(tmp_path: Path) -> None:
    body = LISTEN_BODY.replace('secret_file = "link.secret"', f'secret = "{SECRET_TEXT}"')
    path = config_file(tmp_path, body, mode=0o640)
    refused(lambda: load_config(path), str(path), "secret", f"chmod 600 {path}", "0640")


@posix_only
@pytest.mark.parametrize("depth", [0, 2])
def test_secret_below_a_world_writable_directory_is_refused(tmp_path: Path, depth: int) -> None:
    """A 0600 secret that anyone may rename away and replace (it used to load). ``depth``
    puts the world-writable directory right above the file or two levels higher."""
    shared = tmp_path / "shared"
    holder = shared.joinpath(*(f"d{i}" for i in range(depth)))
    secret = write(holder / "link.secret", SECRET_TEXT)
    shared.chmod(0o777)
    path = config_file(holder, LISTEN_BODY)
    fragments = (str(shared), "writable by everyone", "0777", "without the sticky bit")
    refused(lambda: load_config(path), str(path), "secret_file", *fragments, f"chmod o-w {shared}")
    refused(lambda: read_secret_file(secret), *fragments)
    refused(lambda: write_secret_file(holder / "new.secret"), *fragments)
    assert not (holder / "new.secret").exists()
    body = LISTEN_BODY.replace('secret_file = "link.secret"', f'secret = "{SECRET_TEXT}"')
    inline = config_file(holder, body, name="inline.toml")
    refused(lambda: load_config(inline), str(inline), "secret", *fragments)
    shared.chmod(0o755)
    assert load_config(path).secret == SECRET
    shared.chmod(0o1777)  # sticky, like /tmp, and every entry is ours: safe
    assert load_config(path).secret == SECRET
    assert load_config(inline).secret == SECRET


@posix_only
def test_secret_reached_through_a_symlink_in_a_world_writable_directory_is_refused(
    tmp_path: Path,
) -> None:
    private = tmp_path / "private"
    secret = write(private / "link.secret", SECRET_TEXT)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "link.secret").symlink_to(secret)
    shared.chmod(0o777)
    refused(lambda: read_secret_file(shared / "link.secret"), str(shared), "sticky")
    # ... and the real path's chain counts too: a link from a private place into a shared one.
    shared.chmod(0o755)
    (private / "via").symlink_to(shared)
    shared.chmod(0o777)
    refused(lambda: read_secret_file(private / "via" / "link.secret"), str(shared))
    shared.chmod(0o755)
    assert read_secret_file(private / "via" / "link.secret") == SECRET


@posix_only
@pytest.mark.skipif(POSIX and os.geteuid() != 0, reason="needs root to chown")
def test_sticky_directory_entry_of_another_user_is_refused(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    theirs = sticky / "theirs"
    secret = write(theirs / "link.secret", SECRET_TEXT)
    sticky.chmod(0o1777)
    os.chown(theirs, 12345, 12345)  # another user may rename "theirs" and replace it
    refused(lambda: read_secret_file(secret), str(sticky), "uid 12345", "directory of your own")
    os.chown(theirs, 0, 0)
    assert read_secret_file(secret) == SECRET


# --------------------------------------------------------------------------- LinkConfig in code


def test_link_config_built_in_code() -> None:
    config = make(role="controller", listen=("::1", 0))
    assert config.role is Role.CONTROLLER
    assert config.listen_url == "ws://[::1]:0/executor"
    assert config.source is None
    assert_no_leak(repr(config), str(config))
    with pytest.raises(ValueError, match="listens"):
        _ = config.dial_host
    dialer = make(listen=None, dial="wss://h.example/executor")
    with pytest.raises(ValueError, match="dials"):
        _ = dialer.listen_url


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"executor_id": ""}, ["executor_id", "1-200"]),
        ({"executor_id": "a\tb"}, ["executor_id", "whitespace"]),
        ({"executor_id": "a\x00b"}, ["executor_id", "unprintable"]),
        ({"executor_id": None}, ["executor_id", "expected a string"]),
        ({"role": "boss"}, ["role", "'boss'"]),
        ({"role": 3}, ["role", "an integer"]),
        ({"secret": SECRET_TEXT}, ["secret", "expected a Secret, got a string"]),
        ({"allow_insecure_development": 1}, ["allow_insecure_development", "an integer"]),
        ({"dial": "wss://h/executor"}, ["exactly one of listen and dial"]),
        ({"listen": None}, ["exactly one of listen and dial"]),
        ({"listen": ("127.0.0.1", -1)}, ["[connection] listen", "-1"]),
        ({"listen": ("127.0.0.1", 65536)}, ["[connection] listen", "65536"]),
        ({"listen": ("127.0.0.1", True)}, ["[connection] listen", "(host, port)"]),
        ({"listen": "127.0.0.1:8765"}, ["[connection] listen", "(host, port)"]),
        ({"listen": ("192.168.1.5", 8765)}, ["[connection] listen", "allow_insecure"]),
        ({"listen": None, "dial": b"wss://h/executor"}, ["[connection] dial", "expected a string"]),
        ({"tls": "yes"}, ["[tls]", "expected TlsConfig"]),
        ({"limits": {}}, ["[limits]", "expected Limits"]),
        ({"source": "x.toml"}, ["source", "expected a Path"]),
    ],
)
def test_link_config_refusals_in_code(overrides: dict[str, object], fragments: list[str]) -> None:
    refused(lambda: make(**overrides), "LinkConfig", *fragments)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.255.0.9", "::1", "localhost", "LOCALHOST"])
def test_loopback_needs_no_flag(host: str) -> None:
    assert make(listen=(host, 1)).listen == (host, 1)
    shown = f"[{host}]" if ":" in host else host
    assert make(listen=None, dial=f"ws://{shown}:1/executor").dial_port == 1


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "example.com", "::ffff:127.0.0.1"])
def test_non_loopback_plain_text_needs_flag(host: str) -> None:
    refused(lambda: make(listen=(host, 1)), "allow_insecure_development")
    assert make(listen=(host, 1), allow_insecure_development=True).listen == (host, 1)


def test_userinfo_never_echoed() -> None:
    exc = refused(lambda: make(listen=None, dial="ws://admin:hunter2@h/executor"), "userinfo")
    assert "hunter2" not in str(exc)


# --------------------------------------------------------------------------- Secret


def test_secret_is_redacted_and_compared() -> None:
    secret = Secret(SECRET_TEXT.encode())
    assert repr(secret) == str(secret) == f"{secret}" == "Secret(<redacted, 43 bytes>)"
    assert secret.reveal() == SECRET_TEXT.encode()
    assert len(secret) == 43
    assert secret == SECRET
    assert hash(secret) == hash(SECRET)
    assert secret != Secret(b"y" * 43)
    assert secret != Secret(SECRET_TEXT.encode() + b"!")
    assert secret != SECRET_TEXT.encode()
    assert Secret(bytearray(b"z" * 32)).reveal() == b"z" * 32
    assert copy.copy(secret) is secret
    assert copy.deepcopy(secret) is secret
    with pytest.raises(AttributeError):
        secret._value = b"x" * 32


def test_secret_cannot_be_pickled() -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(SECRET, protocol=protocol)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(make())


def test_secret_refuses_short_or_wrong_values() -> None:
    refused(lambda: Secret(b"x" * (MIN_SECRET_BYTES - 1)), "31 bytes", "at least 32")
    with pytest.raises(TypeError):
        Secret(SECRET_TEXT)  # type: ignore[arg-type]


def test_generate_secret() -> None:
    first, second = generate_secret(), generate_secret()
    assert len(first.reveal()) == 32
    assert first != second


# --------------------------------------------------------------------------- secret files


@posix_only
def test_write_secret_file_is_private_and_loadable(tmp_path: Path) -> None:
    previous = os.umask(0)  # the 0600 mode must not depend on the umask
    try:
        path = write_secret_file(tmp_path / "link.secret")
    finally:
        os.umask(previous)
    assert path == tmp_path / "link.secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text) == 65
    assert text.endswith("\n")
    assert bytes.fromhex(text.strip())
    config = load_config(config_file(tmp_path, LISTEN_BODY))
    assert config.secret.reveal() == bytes.fromhex(text)
    assert read_secret_file(path) == config.secret


def test_write_secret_file_refuses_overwrite(tmp_path: Path) -> None:
    path = write_secret_file(str(tmp_path / "link.secret"))
    before = path.read_text()
    refused(lambda: write_secret_file(path), str(path), "--force", "refusing to overwrite")
    assert path.read_text() == before


@posix_only
def test_write_secret_file_force_replaces(tmp_path: Path) -> None:
    path = write(tmp_path / "link.secret", "old contents", 0o644)
    assert write_secret_file(path, force=True) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.read_text()) == 65
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.secret"]  # no temp left behind
    first = path.read_text()
    write_secret_file(path, force=True)
    assert path.read_text() != first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("force", [False, True])
def test_write_secret_file_missing_directory(tmp_path: Path, force: bool) -> None:
    path = tmp_path / "no" / "such" / "link.secret"
    refused(lambda: write_secret_file(path, force=force), str(path), "cannot write")


def test_read_secret_file_missing(tmp_path: Path) -> None:
    path = tmp_path / "none"
    refused(lambda: read_secret_file(path), str(path), "does not exist", "keygen")


# --------------------------------------------------------------------------- TLS


class TlsFiles:
    def __init__(self, root: Path, ca: trustme.CA) -> None:
        self.ca = ca
        self.ca_pem = root / "ca.pem"
        self.cert = root / "server.pem"
        self.key = root / "server.key"
        self.combined = root / "combined.pem"
        ca.cert_pem.write_to_path(str(self.ca_pem))
        issued = ca.issue_cert("localhost", "127.0.0.1")
        issued.private_key_pem.write_to_path(str(self.key))
        for i, blob in enumerate(issued.cert_chain_pems):
            blob.write_to_path(str(self.cert), append=i > 0)
        issued.private_key_and_cert_chain_pem.write_to_path(str(self.combined))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return TlsFiles(tmp_path_factory.mktemp("tls"), trustme.CA())


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> str:
    """Run a TLS handshake through memory BIOs; return the negotiated version."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_out, client_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = server.wrap_bio(to_server, server_out, server_side=True)
    client_side = client.wrap_bio(to_client, client_out, server_hostname=hostname)
    done = {"server": False, "client": False}
    for _ in range(20):
        for name, side in (("client", client_side), ("server", server_side)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        to_server.write(client_out.read())
        to_client.write(server_out.read())
        if all(done.values()):
            break
    assert all(done.values())
    version = client_side.version()
    assert version is not None
    return version


def test_tls_contexts_handshake(tls_files: TlsFiles) -> None:
    server = TlsConfig(cert=tls_files.cert, key=tls_files.key).server_context()
    client = TlsConfig(ca=tls_files.ca_pem).client_context()
    assert client.verify_mode == ssl.CERT_REQUIRED
    assert client.check_hostname
    assert handshake(server, client, "localhost") in ("TLSv1.2", "TLSv1.3")


def test_tls_cert_file_holding_the_key(tls_files: TlsFiles) -> None:
    server = TlsConfig(cert=tls_files.combined).server_context()
    handshake(server, TlsConfig(ca=tls_files.ca_pem).client_context(), "127.0.0.1")


def test_tls_client_trusts_only_the_configured_ca(tls_files: TlsFiles, tmp_path: Path) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    server = TlsConfig(cert=tls_files.cert, key=tls_files.key).server_context()
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, TlsConfig(ca=other).client_context(), "localhost")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server, TlsConfig(ca=tls_files.ca_pem).client_context(), "wrong.example")


def test_tls_client_certificate(tls_files: TlsFiles) -> None:
    server = TlsConfig(tls_files.cert, tls_files.key, tls_files.ca_pem).server_context()
    assert server.verify_mode == ssl.CERT_OPTIONAL
    client = TlsConfig(tls_files.cert, tls_files.key, tls_files.ca_pem).client_context()
    handshake(server, client, "localhost")
    handshake(server, TlsConfig(ca=tls_files.ca_pem).client_context(), "localhost")


def test_tls_from_config_file(tls_files: TlsFiles, tmp_path: Path, secret_file: Path) -> None:
    tls = (
        f'[tls]\ncert = "{tls_files.cert.as_posix()}"\nkey = "{tls_files.key.as_posix()}"\n'
        f'ca = "{tls_files.ca_pem.as_posix()}"\n'
    )
    listener = load_config(config_file(tmp_path, body_with('listen = "0.0.0.0:0"', tls)))
    server = listener.ssl_context()
    dialer = load_config(
        config_file(
            tmp_path,
            body_with('dial = "wss://localhost:8765/executor"', tls),
            name="dialer.toml",
        )
    )
    client = dialer.ssl_context()
    assert server is not None
    assert client is not None
    handshake(server, client, dialer.dial_host)
    plain = make(listen=None, dial="ws://127.0.0.1/executor")
    assert plain.ssl_context() is None
    assert make(listen=None, dial="wss://h.example/executor").ssl_context() is not None


def test_tls_relative_paths_resolve_against_config_dir(tmp_path: Path) -> None:
    write(tmp_path / "conf" / "link.secret", SECRET_TEXT)
    body = body_with('listen = "0.0.0.0:8765"', '[tls]\ncert = "certs/s.pem"\nca = "../ca.pem"\n')
    config = load_config(config_file(tmp_path / "conf", body))
    assert config.tls == TlsConfig(
        cert=tmp_path / "conf" / "certs" / "s.pem", ca=tmp_path / "conf" / "../ca.pem"
    )
    # Missing files are found when the context is built; the message names file and config.
    refused(
        config.ssl_context,
        str(config.source),
        "[tls] cert",
        str(tmp_path / "conf" / "certs" / "s.pem"),
        "does not exist",
    )


@pytest.mark.parametrize("missing", ["cert", "key", "ca"])
def test_tls_missing_file_named(tls_files: TlsFiles, tmp_path: Path, missing: str) -> None:
    files = {"cert": tls_files.cert, "key": tls_files.key, "ca": tls_files.ca_pem}
    files[missing] = tmp_path / f"missing-{missing}.pem"
    tls = TlsConfig(**files)
    refused(tls.server_context, f"[tls] {missing}", str(files[missing]), "does not exist")
    refused(tls.client_context, f"[tls] {missing}", str(files[missing]), "does not exist")


def test_tls_bad_pem_named(tls_files: TlsFiles, tmp_path: Path) -> None:
    junk = write(tmp_path / "junk.pem", "not a certificate\n")
    refused(TlsConfig(cert=junk).server_context, "[tls] cert", str(junk))
    refused(TlsConfig(cert=tls_files.cert, key=junk).server_context, "[tls] cert", str(junk))
    refused(TlsConfig(ca=junk).client_context, "[tls] ca", str(junk))
    refused(TlsConfig(cert=tls_files.combined, ca=junk).server_context, "[tls] ca", str(junk))
    refused(TlsConfig(cert=tmp_path).server_context, "[tls] cert", "not a regular file")


def test_tls_mismatched_key_named(tls_files: TlsFiles, tmp_path: Path) -> None:
    other_key = tmp_path / "other.key"
    tls_files.ca.issue_cert("other.example").private_key_pem.write_to_path(str(other_key))
    refused(
        TlsConfig(cert=tls_files.cert, key=other_key).server_context,
        "[tls] cert",
        str(other_key),
        "matches the certificate",
    )


def test_tls_encrypted_key_does_not_prompt(tls_files: TlsFiles, tmp_path: Path) -> None:
    # An encrypted key must fail fast with a ConfigError instead of prompting on the terminal.
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(tls_files.key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pass"),
        )
    )
    refused(
        TlsConfig(cert=tls_files.cert, key=encrypted).server_context, "[tls] cert", "unencrypted"
    )


def test_tls_config_rules() -> None:
    refused(lambda: TlsConfig(key=Path("k.pem")), "[tls] key", "without a cert")
    refused(TlsConfig().server_context, "[tls] cert", "needs a certificate")
    assert TlsConfig(cert="c.pem").cert == Path("c.pem")  # type: ignore[arg-type]
    refused(lambda: TlsConfig(ca=3), "[tls] ca", "expected a path")  # type: ignore[arg-type]
    assert isinstance(TlsConfig().client_context(), ssl.SSLContext)  # system CAs


def test_every_message_is_secret_free_even_with_secret_in_odd_places(
    tmp_path: Path, secret_file: Path
) -> None:
    # The secret value typed into the wrong field is never echoed back.
    body = LISTEN_BODY.replace('secret_file = "link.secret"', f"secret = {SECRET_TEXT!r}")
    body = body.replace('"127.0.0.1:8765"', '"127.0.0.1:8765"\nsecret = 1')
    path = config_file(tmp_path, body)
    refused(lambda: load_config(path), str(path))
    path = config_file(tmp_path, f"allow_insecure_development = {SECRET_TEXT!r}\n" + LISTEN_BODY)
    refused(lambda: load_config(path), str(path), "allow_insecure_development")
    path = config_file(tmp_path, LISTEN_BODY + f"[limits]\nmax_frame_bytes = {SECRET_TEXT!r}\n")
    refused(lambda: load_config(path), str(path), "[limits] max_frame_bytes", "a string")
    path = config_file(tmp_path, LISTEN_BODY.replace('"worker"', repr(SECRET_TEXT)))
    refused(lambda: load_config(path), str(path), "role")
    refused(lambda: make(role=SECRET_TEXT), "role")


# --------------------------------------------------------------------------- fleet configs

FLEET_BODY = """
role = "controller"

[connection]
listen = "127.0.0.1:8443"

[executors]
keyring = "keys"
max_executors = 50
forget_after = 90

[[executors.dial]]
id = "box-1"
url = "ws://127.0.0.1:9001/executor"
secret_file = "box-1.secret"

[[executors.dial]]
id = "box-2"
url = "wss://box-2.example/executor"
secret_file = "box-2.secret"

[limits]
heartbeat_interval = 2.0
"""


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    (tmp_path / "keys").mkdir(mode=0o700)
    write(tmp_path / "box-1.secret", SECRET_TEXT + "\n")
    write(tmp_path / "box-2.secret", "ab" * 32 + "\n")
    return tmp_path


def fleet_file(directory: Path, body: str = FLEET_BODY) -> Path:
    return config_file(directory, body, name="fleet.toml")


def test_fleet_config_loads(fleet_dir: Path) -> None:
    path = fleet_file(fleet_dir)
    fleet = load_fleet_config(path)
    assert fleet.source == path
    assert fleet.listen == ("127.0.0.1", 8443)
    assert fleet.keyring == fleet_dir / "keys"
    assert fleet.max_executors == 50
    assert fleet.forget_after == 90.0
    assert isinstance(fleet.forget_after, float)
    assert fleet.limits.heartbeat_interval == 2.0
    assert [d.executor_id for d in fleet.dial] == ["box-1", "box-2"]
    assert fleet.dial[0].secret == SECRET
    assert fleet.dial[1].secret == Secret(bytes.fromhex("ab" * 32))
    assert fleet.listen_url == "ws://127.0.0.1:8443/executor"
    assert fleet.ssl_context() is None
    assert_no_leak(repr(fleet))
    plain = fleet.dial_config(fleet.dial[0])
    assert plain.role is Role.CONTROLLER
    assert plain.executor_id == "box-1"
    assert plain.dial == "ws://127.0.0.1:9001/executor"
    assert plain.secret == SECRET
    assert plain.limits is fleet.limits
    assert plain.tls is None
    assert fleet.dial_config(fleet.dial[1]).dial_tls


def test_fleet_defaults_and_env_var(fleet_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = fleet_file(
        fleet_dir,
        'role = "controller"\n[connection]\nlisten = "127.0.0.1:0"\n'
        '[executors]\nkeyring = "keys"\n',
    )
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    fleet = load_fleet_config()
    assert (fleet.max_executors, fleet.forget_after, fleet.dial) == (10_000, 3600.0, ())
    assert fleet.limits == Limits()


def test_dial_only_fleet_needs_no_keyring(fleet_dir: Path) -> None:
    body = FLEET_BODY.replace('[connection]\nlisten = "127.0.0.1:8443"\n', "").replace(
        'keyring = "keys"\n', ""
    )
    fleet = load_fleet_config(fleet_file(fleet_dir, body))
    assert fleet.listen is None
    assert fleet.keyring is None
    assert fleet.ssl_context() is None
    with pytest.raises(ValueError):
        _ = fleet.listen_url


def test_fleet_listener_tls(tls_files: TlsFiles, fleet_dir: Path) -> None:
    body = FLEET_BODY.replace("127.0.0.1:8443", "0.0.0.0:8443") + (
        f'[tls]\ncert = "{tls_files.cert}"\nkey = "{tls_files.key}"\nca = "{tls_files.ca_pem}"\n'
    )
    fleet = load_fleet_config(fleet_file(fleet_dir, body))
    assert fleet.listen_url == "wss://0.0.0.0:8443/executor"
    assert isinstance(fleet.ssl_context(), ssl.SSLContext)
    # Listening, [tls] is the server's: a ws:// loopback entry is fine and dials without it.
    assert fleet.dial_config(fleet.dial[0]).tls is None
    assert fleet.dial_config(fleet.dial[1]).tls == fleet.tls


def test_load_config_refuses_a_fleet_file(fleet_dir: Path) -> None:
    refused(
        lambda: load_config(fleet_file(fleet_dir)),
        "fleet.toml",
        "[executors]",
        "load_fleet_config",
        "garcon-link fleet",
    )


def test_load_fleet_config_refuses_a_link_file(tmp_path: Path, secret_file: Path) -> None:
    path = config_file(tmp_path, LISTEN_BODY)
    refused(lambda: load_fleet_config(path), "[executors]", "missing", 'keyring = "keys"')


FLEET_REFUSALS = [
    # (replace this, with that, fragments the message must hold)
    ('role = "controller"', 'role = "worker"', ["role", "controller's", 'role = "controller"']),
    ('role = "controller"\n', "", ["role", "missing"]),
    (
        'role = "controller"',
        'role = "controller"\nexecutor_id = "me"',
        ["executor_id", "no executor id", "keys/<id>.secret"],
    ),
    (
        'role = "controller"',
        'role = "controller"\nsecret_file = "box-1.secret"',
        ["secret_file", "no executor id", "keygen --keyring"],
    ),
    ('role = "controller"', 'role = "controller"\nsecret = "x"', ["secret", "own secret_file"]),
    ('role = "controller"', 'role = "controller"\nbogus = 1', ["bogus", "unknown key"]),
    (
        'listen = "127.0.0.1:8443"',
        'listen = "127.0.0.1:8443"\ncontroller_id = "ops"',
        ["[connection] controller_id", "'controller_id' is a top-level key"],
    ),
    (
        'listen = "127.0.0.1:8443"',
        'listen = "127.0.0.1:8443"\ndial = "ws://127.0.0.1:1/executor"',
        ["[connection] dial", "[[executors.dial]]"],
    ),
    (
        'listen = "127.0.0.1:8443"',
        'listen = "0.0.0.0:8443"',
        ["[connection] listen", "plain text", "allow_insecure_development"],
    ),
    ('listen = "127.0.0.1:8443"', 'listen = "8443"', ["[connection] listen", "port"]),
    ('keyring = "keys"\n', "", ["[executors] keyring", "needs a keyring", 'keyring = "keys"']),
    ('keyring = "keys"', 'keyring = "nope"', ["[executors] keyring", "does not exist", "keygen"]),
    ('keyring = "keys"', 'keyring = "box-1.secret"', ["[executors] keyring", "not a directory"]),
    ('keyring = "keys"', "keyring = 5", ["[executors] keyring", "expected a string"]),
    ('keyring = "keys"', 'keyring = "keys"\nspare = 1', ["[executors] spare", "unknown key"]),
    ("max_executors = 50", "max_executors = 0", ["[executors] max_executors", "1-1000000"]),
    ("max_executors = 50", "max_executors = 1000001", ["[executors] max_executors", "1-1000000"]),
    ("max_executors = 50", "max_executors = 1", ["[executors] max_executors", "2 executors"]),
    ("max_executors = 50", "max_executors = 5.5", ["[executors] max_executors", "integer"]),
    ("max_executors = 50", "max_executors = true", ["[executors] max_executors", "integer"]),
    ("forget_after = 90", "forget_after = 0", ["[executors] forget_after", "positive"]),
    ("forget_after = 90", "forget_after = -1.5", ["[executors] forget_after", "positive"]),
    ("forget_after = 90", "forget_after = inf", ["[executors] forget_after", "positive"]),
    ("forget_after = 90", "forget_after = nan", ["[executors] forget_after", "positive"]),
    ("forget_after = 90", "forget_after = 1e300", ["[executors] forget_after", "30 days"]),
    ("forget_after = 90", 'forget_after = "90"', ["[executors] forget_after", "number"]),
    ('id = "box-2"', 'id = "box-1"', ["[[executors.dial]] #2 id", "already dialed by entry #1"]),
    ('id = "box-2"', 'id = "../box"', ["[[executors.dial]] #2 id", "starts with '.'", "rename"]),
    ('id = "box-2"', 'id = "box:2"', ["[[executors.dial]] #2 id", "ASCII letters"]),
    ('id = "box-2"\n', "", ["[[executors.dial]] #2 id", "missing"]),
    ('id = "box-2"', "id = 2", ["[[executors.dial]] #2 id", "expected a string"]),
    (
        'secret_file = "box-2.secret"',
        f'secret = "{SECRET_TEXT}"',
        ["[[executors.dial]] #2 secret", "inline secret", "secret_file"],
    ),
    (
        'secret_file = "box-2.secret"',
        'secret_file = "gone.secret"',
        ["[[executors.dial]] #2 secret_file", "does not exist"],
    ),
    (
        'secret_file = "box-2.secret"',
        'secret_file = "box-2.secret"\nport = 1',
        ["[[executors.dial]] #2 port", "unknown key"],
    ),
    (
        "wss://box-2.example/executor",
        "ws://box-2.example/executor",
        ["[[executors.dial]] #2 url", "plain-text", "allow_insecure_development"],
    ),
    (
        "wss://box-2.example/executor",
        "wss://box-2.example/other",
        ["[[executors.dial]] #2 url", "/executor"],
    ),
    (
        "wss://box-2.example/executor",
        "https://box-2.example/executor",
        ["[[executors.dial]] #2 url", "not ws or wss"],
    ),
    (
        "[limits]\nheartbeat_interval = 2.0",
        "[limits]\nheartbeat = 2.0",
        ["[limits] heartbeat", "unknown key"],
    ),
]


@pytest.mark.parametrize(("old", "new", "fragments"), FLEET_REFUSALS)
def test_fleet_refusals(fleet_dir: Path, old: str, new: str, fragments: list[str]) -> None:
    assert old in FLEET_BODY
    path = fleet_file(fleet_dir, FLEET_BODY.replace(old, new, 1))
    refused(lambda: load_fleet_config(path), "fleet.toml", *fragments)


def test_fleet_that_neither_listens_nor_dials_is_refused(fleet_dir: Path) -> None:
    path = fleet_file(fleet_dir, 'role = "controller"\n[executors]\nmax_executors = 5\n')
    refused(lambda: load_fleet_config(path), "neither listens nor dials", "[[executors.dial]]")


def test_fleet_dial_entries_must_be_tables(fleet_dir: Path) -> None:
    path = fleet_file(fleet_dir, 'role = "controller"\n[executors]\ndial = [1]\n')
    refused(lambda: load_fleet_config(path), "[[executors.dial]] #1", "expected a table")


def test_fleet_tls_with_ws_dial_only_is_refused(tls_files: TlsFiles, fleet_dir: Path) -> None:
    body = (
        'role = "controller"\n[executors]\n[[executors.dial]]\nid = "box-1"\n'
        'url = "ws://127.0.0.1:9001/executor"\nsecret_file = "box-1.secret"\n'
        f'[tls]\nca = "{tls_files.ca_pem}"\n'
    )
    refused(
        lambda: load_fleet_config(fleet_file(fleet_dir, body)),
        "[tls]",
        "#1 url",
        "plain ws://",
        "remove [tls]",
    )


@posix_only
def test_fleet_keyring_in_a_world_writable_directory_is_refused(fleet_dir: Path) -> None:
    (fleet_dir / "keys").chmod(0o777)
    refused(
        lambda: load_fleet_config(fleet_file(fleet_dir)),
        "[executors] keyring",
        "writable by everyone",
        "chmod o-w",
    )


@posix_only
def test_fleet_dial_secret_file_must_be_private(fleet_dir: Path) -> None:
    (fleet_dir / "box-1.secret").chmod(0o644)
    refused(
        lambda: load_fleet_config(fleet_file(fleet_dir)),
        "[[executors.dial]] #1 secret_file",
        "chmod 600",
    )


def test_fleet_config_built_in_code(tmp_path: Path) -> None:
    entry = DialExecutor("box-1", "ws://127.0.0.1:9001/executor", SECRET)
    fleet = FleetConfig(dial=[entry], forget_after=5)  # type: ignore[arg-type]
    assert fleet.dial == (entry,)
    assert fleet.forget_after == 5.0
    listening = FleetConfig(listen=("127.0.0.1", 0), keyring=str(tmp_path))  # type: ignore[arg-type]
    assert listening.keyring == tmp_path
    assert listening.source is None


@pytest.mark.parametrize(
    ("build", "fragments"),
    [
        (lambda: FleetConfig(), ["FleetConfig", "neither listens nor dials"]),
        (lambda: FleetConfig(listen=("127.0.0.1", 0)), ["FleetConfig", "[executors] keyring"]),
        (lambda: FleetConfig(keyring=Path("k")), ["FleetConfig", "[connection] listen"]),
        (lambda: FleetConfig(dial=("x",)), ["FleetConfig", "DialExecutor"]),  # type: ignore[arg-type]
        (
            lambda: FleetConfig(listen=("127.0.0.1", 0), keyring=Path("k"), max_executors=True),
            ["max_executors", "integer"],
        ),
        (
            lambda: FleetConfig(listen=("127.0.0.1", 0), keyring=Path("k"), forget_after="1"),  # type: ignore[arg-type]
            ["forget_after", "number"],
        ),
        (lambda: DialExecutor("a/b", "ws://127.0.0.1/executor", SECRET), ["DialExecutor", "id"]),
        (lambda: DialExecutor("box", "ws://127.0.0.1/x", SECRET), ["DialExecutor", "url"]),
        (lambda: DialExecutor("box", "ws://127.0.0.1/executor", b"x" * 32), ["secret"]),  # type: ignore[arg-type]
    ],
)
def test_fleet_refusals_in_code(build: Callable[[], object], fragments: list[str]) -> None:
    refused(build, *fragments)


def test_dial_config_refuses_other_things() -> None:
    fleet = FleetConfig(dial=(DialExecutor("box-1", "ws://127.0.0.1:9/executor", SECRET),))
    refused(lambda: fleet.dial_config("box-1"), "DialExecutor")  # type: ignore[arg-type]
