"""Grants and the gateway's and caller's configuration files (settings/grants.py, callers.py).

The matching rules are one table: each row is a set of grants, a (caller, executor, service)
and whether it is allowed and visible. The loaders refuse every malformed entry with a message
naming the file, the field and the fix, within the bounds on counts and pattern lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import garcon_link as gl
from garcon_link.settings.grants import MAX_GRANTS, MAX_PATTERN_CHARS, MAX_PATTERNS, allows, sees
from garcon_link.settings.secrets import write_secret_file

G = gl.Grant
WEB = G(callers=("web-*",), executors=("device-*",), services=("calc", "process"))
OPS = G(callers=("ops",), executors=("*",))
ONE = G(callers=("job-?",), executors=("box-[12]",), services=("calc*",))

# (grants, caller, executor, service, allowed, visible)
TABLE: list[tuple[tuple[gl.Grant, ...], str, str, str, bool, bool]] = [
    ((), "web-1", "device-1", "calc", False, False),  # no grant, no access
    ((WEB,), "web-1", "device-1", "calc", True, True),
    ((WEB,), "web-1", "device-1", "process", True, True),
    ((WEB,), "web-1", "device-1", "files", False, True),  # a service it does not list
    ((WEB,), "web-1", "box-1", "calc", False, False),  # an executor it does not name
    ((WEB,), "api-1", "device-1", "calc", False, False),  # a caller it does not name
    ((WEB,), "web-", "device-", "calc", True, True),  # * matches the empty run
    ((WEB,), "Web-1", "device-1", "calc", False, False),  # case-sensitive
    ((WEB,), "xweb-1", "device-1", "calc", False, False),  # the whole id, anchored
    ((WEB,), "web-1", "device-1x", "calc", True, True),  # * runs to the end
    ((WEB,), "web-1", "device-1", "calcx", False, True),  # a plain name is exact
    ((OPS,), "ops", "anything.1", "files", True, True),  # no services: every service
    ((OPS,), "ops", "anything.1", "$link", False, True),  # internal services never
    ((OPS,), "ops-2", "box-1", "calc", False, False),
    ((ONE,), "job-1", "box-2", "calc2", True, True),  # ? and [..]
    ((ONE,), "job-10", "box-2", "calc", False, False),  # ? is one character
    ((ONE,), "job-1", "box-3", "calc", False, False),  # [12] is a set
    ((WEB, OPS), "ops", "device-1", "files", True, True),  # grants add up
    ((WEB, OPS), "web-1", "device-1", "files", False, True),  # ... and never take away
    ((WEB, ONE), "web-1", "box-1", "calc", False, False),
]


@pytest.mark.parametrize(("grants", "caller", "executor", "service", "allowed", "visible"), TABLE)
def test_the_matching_rules(
    grants: tuple[gl.Grant, ...],
    caller: str,
    executor: str,
    service: str,
    allowed: bool,
    visible: bool,
) -> None:
    assert allows(grants, caller, executor, service) is allowed
    assert sees(grants, caller, executor) is visible


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"callers": (), "executors": ("x",)}, "empty"),
        ({"callers": "web-*", "executors": ("x",)}, "expected a list"),
        ({"callers": ("a" * (MAX_PATTERN_CHARS + 1),), "executors": ("x",)}, "characters"),
        ({"callers": ("web 1",), "executors": ("x",)}, "whitespace"),
        ({"callers": (3,), "executors": ("x",)}, "not a string"),
        ({"callers": ("x",) * (MAX_PATTERNS + 1), "executors": ("x",)}, "patterns, more than"),
        ({"callers": ("x",), "executors": ("x",), "services": ("",)}, "characters"),
    ],
)
def test_a_grant_is_refused_with_its_field(fields: dict[str, object], problem: str) -> None:
    with pytest.raises(gl.ConfigError, match=problem) as refused:
        G(**fields)  # type: ignore[arg-type]
    assert "[[callers.grant]] #1" in str(refused.value)


def _gateway_file(tmp_path: Path, callers: str) -> Path:
    (tmp_path / "keys").mkdir(mode=0o700, exist_ok=True)
    (tmp_path / "callers").mkdir(mode=0o700, exist_ok=True)
    path = tmp_path / "gateway.toml"
    path.write_text(
        'role = "gateway"\n[connection]\nlisten = "127.0.0.1:0"\n[executors]\n'
        f'keyring = "keys"\n{callers}',
        encoding="utf-8",
    )
    return path


def test_a_gateway_file_loads(tmp_path: Path) -> None:
    path = _gateway_file(
        tmp_path,
        '[callers]\nkeyring = "callers"\nmax_callers = 5\n'
        '[[callers.grant]]\ncallers = ["web-*"]\nexecutors = ["device-*"]\nservices = ["calc"]\n'
        '[[callers.grant]]\ncallers = ["ops"]\nexecutors = ["*"]\n',
    )
    config = gl.load_gateway_config(path)
    assert config.callers.max_callers == 5
    assert config.callers.keyring == tmp_path / "callers"
    assert [g.services for g in config.callers.grants] == [("calc",), ()]
    assert config.fleet.listen == ("127.0.0.1", 0)


@pytest.mark.parametrize(
    ("callers", "field", "problem"),
    [
        ("", "[callers]", "missing"),
        ("[callers]\n", "[callers] keyring", "missing"),
        ('[callers]\nkeyring = "nowhere"\n', "[callers] keyring", ""),
        ('[callers]\nkeyring = "callers"\ncolour = 1\n', "[callers] colour", "unknown key"),
        ('[callers]\nkeyring = "callers"\nmax_callers = 0\n', "[callers] max_callers", "1-4096"),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["a"]\n',
            "[[callers.grant]] #1 executors",
            "missing",
        ),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["a"]\n'
            'executors = ["b"]\nwho = 1\n',
            "[[callers.grant]] #1 who",
            "unknown key",
        ),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = "a"\nexecutors = ["b"]\n',
            "[[callers.grant]] #1 callers",
            "expected a list",
        ),
        (
            '[callers]\nkeyring = "callers"\n[callers.grant]\ncallers = ["a"]\nexecutors = ["b"]\n',
            "[[callers.grant]]",
            "double brackets",
        ),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["a"]\n'
            'executors = ["b"]\nservices = ["calc", "$describe"]\n',
            "[[callers.grant]] #1 services",
            "internal service",
        ),
        # An explicit services that names nothing is refused, never read as "every service".
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["a"]\n'
            'executors = ["b"]\nservices = []\n',
            "[[callers.grant]] #1 services",
            "remove the field to grant every service",
        ),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["a"]\n'
            'executors = ["b"]\nservices = false\n',
            "[[callers.grant]] #1 services",
            "expected a list of patterns, got a boolean",
        ),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = ["a"]\n'
            'executors = ["b"]\nservices = 0\n',
            "[[callers.grant]] #1 services",
            "expected a list of patterns, got an integer",
        ),
        (
            '[callers]\nkeyring = "callers"\n[[callers.grant]]\ncallers = [1]\nexecutors = ["b"]\n',
            "[[callers.grant]] #1 callers",
            "a pattern is an integer, not a string",
        ),
        (
            '[callers]\nkeyring = "callers"\n'
            + '[[callers.grant]]\ncallers = ["a"]\nexecutors = ["b"]\n' * (MAX_GRANTS + 1),
            "[[callers.grant]]",
            "more than",
        ),
    ],
)
def test_a_gateway_file_is_refused_naming_file_and_field(
    tmp_path: Path, callers: str, field: str, problem: str
) -> None:
    path = _gateway_file(tmp_path, callers)
    with pytest.raises(gl.ConfigError) as refused:
        gl.load_gateway_config(path)
    text = str(refused.value)
    assert text.startswith(f"{path}: {field}: ") and problem in text and "; " in text


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("gateway_forbidden_rate = 0", "must be > 0, got 0.0"),
        ("gateway_forbidden_rate = -5", "must be > 0"),
        ("gateway_forbidden_rate = nan", "must be finite"),
        ("gateway_forbidden_rate = 1e12", "must be at most 1000000, got 1000000000000.0"),
        ("gateway_forbidden_burst = 0", "must be > 0"),
        ("gateway_forbidden_burst = 2.5", "must be an integer"),
        ("gateway_forbidden_burst = 1_000_000_000", "must be at most 1000000"),
        ("gateway_forbidden_delay = inf", "must be finite"),
        ("gateway_forbidden_delay = 3600", "must be at most 30"),
        ("gateway_caller_share = 0", "must be > 0"),
        ("gateway_caller_share = 4", "must be at most 1, got 4.0 (default 0.25)"),
        ("gateway_refresh_interval = 0.0001", "must be at least 0.01"),
        ("gateway_refresh_interval = 1e9", "must be at most 3600"),
    ],
)
def test_a_careless_gateway_limit_is_one_line_naming_it(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = _gateway_file(tmp_path, f'[callers]\nkeyring = "callers"\n[limits]\n{line}\n')
    with pytest.raises(gl.ConfigError) as refused:
        gl.load_gateway_config(path)
    text = str(refused.value)
    key = line.split(" = ")[0]
    assert "\n" not in text and f"Limits.{key} {problem}" in text, text
    assert text.startswith(f"{path}: [limits]: ") and text.endswith("; fix the value in [limits]")


def test_a_gateway_whose_callers_share_the_executors_keyring_is_refused(tmp_path: Path) -> None:
    # One directory for both would let an executor's key call as a caller of that id, and a
    # caller's key join the fleet as an executor of its id.
    path = _gateway_file(tmp_path, '[callers]\nkeyring = "keys"\n')
    with pytest.raises(gl.ConfigError) as refused:
        gl.load_gateway_config(path)
    text = str(refused.value)
    assert text.startswith(f"{path}: [callers] keyring: ") and "[executors] keyring" in text
    (tmp_path / "alias").symlink_to(tmp_path / "keys")  # the same directory by another name
    path = _gateway_file(tmp_path, '[callers]\nkeyring = "alias"\n')
    with pytest.raises(gl.ConfigError, match="the same directory"):
        gl.load_gateway_config(path)


def test_the_gateway_limits_load_from_the_gateway_file(tmp_path: Path) -> None:
    path = _gateway_file(
        tmp_path,
        '[callers]\nkeyring = "callers"\n[limits]\ngateway_forbidden_rate = 5\n'
        "gateway_forbidden_burst = 3\ngateway_forbidden_delay = 0.5\n"
        "gateway_caller_share = 0.5\n",
    )
    limits = gl.load_gateway_config(path).limits
    assert (
        limits.gateway_forbidden_rate,
        limits.gateway_forbidden_burst,
        limits.gateway_forbidden_delay,
        limits.gateway_caller_share,
    ) == (5.0, 3, 0.5, 0.5)


def test_a_fleet_loader_points_a_gateway_file_to_its_loader(tmp_path: Path) -> None:
    path = _gateway_file(tmp_path, '[callers]\nkeyring = "callers"\n')
    text = path.read_text().replace('role = "gateway"', 'role = "controller"')
    path.write_text(text)
    with pytest.raises(gl.ConfigError, match="load_gateway_config"):
        gl.load_fleet_config(path)


def _caller_file(tmp_path: Path, body: str) -> Path:
    secret = tmp_path / "web-1.secret"
    if not secret.exists():
        write_secret_file(secret)
    path = tmp_path / "caller.toml"
    path.write_text(body, encoding="utf-8")
    return path


CALLER = (
    'role = "caller"\ncaller_id = "web-1"\nsecret_file = "web-1.secret"\n'
    '[connection]\ndial = "ws://127.0.0.1:8443/executor"\n'
)


def test_a_caller_file_loads(tmp_path: Path) -> None:
    config = gl.load_caller_config(_caller_file(tmp_path, CALLER))
    assert config.caller_id == "web-1" and config.dial == "ws://127.0.0.1:8443/executor"
    link = config.link_config()
    assert link.executor_id == "web-1" and link.role is gl.Role.CONTROLLER


@pytest.mark.parametrize(
    ("body", "field", "problem"),
    [
        (CALLER.replace('"caller"', '"worker"'), "role", "role caller"),
        (CALLER.replace('"web-1"\n', '"../x"\n', 1), "caller_id", "caller id"),
        (CALLER.replace('caller_id = "web-1"\n', ""), "caller_id", "missing"),
        (CALLER.replace('caller_id = "web-1"', "caller_id = 7"), "caller_id", "expected a string"),
        (CALLER.replace('secret_file = "web-1.secret"\n', ""), "secret_file", "missing"),
        (CALLER.replace("[connection]", 'secret = "x"\n[connection]'), "secret", "inline"),
        (CALLER.replace("ws://127.0.0.1:8443", "ws://example.com"), "[connection] dial", ""),
        (CALLER.replace("[connection]", "colour = 1\n[connection]"), "colour", "unknown key"),
        (CALLER.replace("dial =", "listen ="), "[connection] listen", "unknown key"),
    ],
)
def test_a_caller_file_is_refused_naming_file_and_field(
    tmp_path: Path, body: str, field: str, problem: str
) -> None:
    path = _caller_file(tmp_path, body)
    with pytest.raises(gl.ConfigError) as refused:
        gl.load_caller_config(path)
    text = str(refused.value)
    assert f": {field}: " in text and problem in text, text
    assert str(path) in text or "CallerConfig" in text or "LinkConfig" in text


@pytest.mark.parametrize("loader", [gl.load_config, gl.load_fleet_config])
def test_a_gateway_or_caller_file_given_to_another_loader_names_its_command(
    tmp_path: Path, loader: Callable[[Path], object]
) -> None:
    caller = _caller_file(tmp_path, CALLER)
    with pytest.raises(gl.ConfigError) as refused:
        loader(caller)
    assert str(refused.value).startswith(f"{caller}: role: ")
    assert "garcon-link call CONFIG --executor ID" in str(refused.value)
    gateway = _gateway_file(tmp_path, '[callers]\nkeyring = "callers"\n')
    with pytest.raises(gl.ConfigError) as refused:
        loader(gateway)
    assert str(refused.value).startswith(f"{gateway}: role: ")
    assert "garcon-link gateway CONFIG" in str(refused.value)
    assert 'role = "caller"' in str(refused.value)
