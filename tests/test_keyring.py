"""The keyring: the executor-id rule, per-handshake key lookup, refusals, warnings, enrollment."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from garcon_link.core.wire import Role
from garcon_link.errors import ConfigError
from garcon_link.net.addresses import MAX_EXECUTOR_ID_CHARS
from garcon_link.settings.config import LinkConfig
from garcon_link.settings.keyring import MAX_ENROLLED_SCAN, Keyring, enroll, executor_id_problem
from garcon_link.settings.secrets import Secret, read_secret_file

POSIX = os.name == "posix"
posix_only = pytest.mark.skipif(not POSIX, reason="file modes are only checked on POSIX")

HEX = "ab" * 32  # a valid 32-byte secret in hex; no log line may contain it
LOGGER = "garcon_link.keyring"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_key(path: Path, text: str = HEX + "\n", mode: int = 0o600) -> Path:
    path.write_text(text, encoding="ascii")
    path.chmod(mode)
    return path


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def keyring(keys: Path, clock: FakeClock) -> Keyring:
    return Keyring(keys, clock=clock)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


def assert_secret_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert HEX not in record.getMessage()
    assert HEX not in caplog.text


# --------------------------------------------------------------------------- the id rule

REFUSED_IDS: list[object] = [
    "../x",
    "..",
    ".",
    "a/b",
    "/etc/passwd",
    "a\x00b",
    "x" * (MAX_EXECUTOR_ID_CHARS + 1),
    "x" * 300,
    ".hidden",
    "",
    "box 1",
    "box:1",
    "box\n",
    "caf\u00e9",
    "\ud800",
    "box-\udcff",
    "a\\b",
    b"box-1",
    None,
    42,
    ["box-1"],
]


@pytest.mark.parametrize("value", REFUSED_IDS, ids=repr)
def test_refused_ids_have_a_problem(value: object) -> None:
    problem = executor_id_problem(value)
    assert isinstance(problem, str)
    assert problem
    if isinstance(value, str) and len(value) > 20:
        assert value not in problem  # never echoed


@pytest.mark.parametrize(
    "value", ["box-1", "a", "B_2.x-y", "x" * MAX_EXECUTOR_ID_CHARS, "a..b", "1.2.3", "-x", "_"]
)
def test_accepted_ids(value: str) -> None:
    assert executor_id_problem(value) is None


@given(st.one_of(st.text(), st.binary(), st.integers(), st.none(), st.floats()))
def test_executor_id_problem_never_raises_and_accepts_only_safe_names(value: object) -> None:
    problem = executor_id_problem(value)
    if problem is None:
        assert isinstance(value, str)
        assert "/" not in value
        assert "\x00" not in value
        assert not value.startswith(".")
        assert 1 <= len(value) <= MAX_EXECUTOR_ID_CHARS
        assert value.isascii()
    else:
        assert isinstance(problem, str)


@pytest.fixture(scope="module")
def empty_keyring(tmp_path_factory: pytest.TempPathFactory) -> Keyring:
    return Keyring(tmp_path_factory.mktemp("empty-keyring"))


# Any text, lone surrogates and control characters included.
@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=300))
def test_secret_for_never_raises_for_any_text(empty_keyring: Keyring, value: str) -> None:
    assert empty_keyring.secret_for(value) is None


def test_worker_ids_the_keyring_refuses_still_load_as_link_configs() -> None:
    # Compatibility: a config's executor_id stays "printable, no whitespace".
    for ident in ("box:1", "caf\u00e9", ".box", "a/b"):
        config = LinkConfig(
            executor_id=ident,
            role=Role.WORKER,
            secret=Secret(b"s" * 32),
            listen=("127.0.0.1", 0),
        )
        assert config.executor_id == ident
        assert executor_id_problem(ident) is not None


@pytest.mark.parametrize("value", REFUSED_IDS, ids=repr)
def test_refused_ids_never_reach_the_file_system(
    value: object,
    tmp_path: Path,
    keyring: Keyring,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A file the traversal ids would reach if they were used as paths.
    write_key(tmp_path / "x.secret")
    write_key(keyring.directory / "..secret")
    calls: list[tuple[str, object]] = []

    def recorder(name: str) -> object:
        def refuse(*args: object, **kwargs: object) -> object:
            calls.append((name, args[0] if args else None))
            raise AssertionError(f"os.{name} called for a refused id")

        return refuse

    for name in ("open", "stat", "lstat", "scandir", "listdir"):
        monkeypatch.setattr(os, name, recorder(name))
    caplog.set_level(logging.DEBUG, LOGGER)
    assert keyring.secret_for(value) is None  # type: ignore[arg-type]
    monkeypatch.undo()
    assert calls == []
    assert warnings_of(caplog) == []


# --------------------------------------------------------------------------- lookups


def test_enrolled_key_is_found(keys: Path, keyring: Keyring) -> None:
    path = enroll(keys, "box-1")
    assert path == keys / "box-1.secret"
    found = keyring.secret_for("box-1")
    assert found is not None
    assert found == read_secret_file(path)
    assert keyring.secret_for("box-2") is None


def test_adding_enrolls_and_deleting_revokes_at_once(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    assert keyring.secret_for("box-1") is None
    assert "not enrolled" in caplog.text
    assert warnings_of(caplog) == []
    write_key(keys / "box-1.secret")
    first = keyring.secret_for("box-1")
    assert first == Secret(bytes.fromhex(HEX))
    (keys / "box-1.secret").unlink()
    assert keyring.secret_for("box-1") is None
    # Rotation: a new file is read at the next lookup, nothing is cached.
    write_key(keys / "box-1.secret", "cd" * 32)
    assert keyring.secret_for("box-1") == Secret(bytes.fromhex("cd" * 32))
    assert_secret_never_logged(caplog)


def test_plain_text_secrets_decode_like_config_files(keys: Path, keyring: Keyring) -> None:
    text = "a plain text secret that is long enough!!"
    write_key(keys / "box-1.secret", f"  {text}\n")
    assert keyring.secret_for("box-1") == Secret(text.encode())


@posix_only
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_group_or_world_readable_key_is_refused_with_the_fix(
    keys: Path, keyring: Keyring, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_key(keys / "box-1.secret", mode=mode)
    assert keyring.secret_for("box-1") is None
    [warning] = warnings_of(caplog)
    assert str(path) in warning
    assert f"chmod 600 {path}" in warning
    assert "box-1" in warning
    assert f"{mode:04o}" in warning
    assert_secret_never_logged(caplog)
    path.chmod(0o600)
    assert keyring.secret_for("box-1") is not None


@posix_only
@pytest.mark.skipif(POSIX and os.geteuid() == 0, reason="root reads any directory")
@pytest.mark.parametrize("mode", [0o300, 0o600, 0o000])
def test_a_keyring_this_user_cannot_read_fails_at_startup(tmp_path: Path, mode: int) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    keys.chmod(mode)
    try:
        with pytest.raises(ConfigError, match="cannot be read by this user") as refused:
            Keyring(keys, kind="caller")
        assert str(keys) in str(refused.value) and "\n" not in str(refused.value)
    finally:
        keys.chmod(0o700)


@posix_only
def test_a_caller_keyring_names_callers_in_its_warnings(
    keys: Path, caplog: pytest.LogCaptureFixture
) -> None:
    callers = Keyring(keys, kind="caller")
    path = write_key(keys / "web-1.secret", mode=0o644)
    assert callers.secret_for("web-1") is None
    path.write_bytes(b"")
    path.chmod(0o600)
    assert callers.secret_for("web-1") is None
    warnings = warnings_of(caplog)
    assert len(warnings) == 2 and all(w.startswith("caller web-1 refused: ") for w in warnings)
    assert "--keyring DIR --caller ID --force" in warnings[1]
    assert not any("executor" in w for w in warnings), warnings


@posix_only
def test_refusal_warning_is_rate_limited_per_file_and_problem(
    keys: Path, keyring: Keyring, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    write_key(keys / "box-1.secret", mode=0o644)
    write_key(keys / "box-2.secret", mode=0o644)
    for _ in range(50):  # a redialing worker
        assert keyring.secret_for("box-1") is None
    assert len(warnings_of(caplog)) == 1
    assert keyring.secret_for("box-2") is None  # another file: its own warning
    assert len(warnings_of(caplog)) == 2
    clock.now += 59.9
    assert keyring.secret_for("box-1") is None
    assert len(warnings_of(caplog)) == 2
    clock.now += 0.1
    assert keyring.secret_for("box-1") is None
    assert len(warnings_of(caplog)) == 3
    # Another problem with the same file is news at once.
    write_key(keys / "box-1.secret", "short", mode=0o600)
    assert keyring.secret_for("box-1") is None
    assert len(warnings_of(caplog)) == 4
    assert "at least 32" in warnings_of(caplog)[-1]


@posix_only
def test_rate_limit_memory_is_bounded(
    keys: Path, keyring: Keyring, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    from garcon_link.settings import keyring as module

    for index in range(module._MAX_WARNED + 10):
        keyring._warn("box", keys / f"f{index}", "problem", "fix")
    assert len(keyring._warned) <= module._MAX_WARNED
    assert len(warnings_of(caplog)) == module._MAX_WARNED + 10


def test_symlinked_key_file_is_refused(
    tmp_path: Path, keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    target = write_key(tmp_path / "elsewhere.secret")
    assert read_secret_file(target) is not None  # the target itself is a good key
    (keys / "box-1.secret").symlink_to(target)
    assert keyring.secret_for("box-1") is None
    [warning] = warnings_of(caplog)
    assert "symbolic link" in warning
    assert str(keys / "box-1.secret") in warning


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.timeout(10)
def test_fifo_is_refused_without_hanging(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    os.mkfifo(keys / "box-1.secret", 0o600)
    assert keyring.secret_for("box-1") is None
    [warning] = warnings_of(caplog)
    assert "not a regular file" in warning


def test_directory_named_like_a_key_is_refused(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    (keys / "box-1.secret").mkdir()
    assert keyring.secret_for("box-1") is None
    assert "not a regular file" in warnings_of(caplog)[0]


def test_oversize_key_file_is_refused(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    write_key(keys / "box-1.secret", "ab" * (64 * 1024))
    assert keyring.secret_for("box-1") is None
    assert "larger than" in warnings_of(caplog)[0]


@pytest.mark.parametrize("text", ["", "short", "x" * 31, " " * 40 + "x" * 31 + "\n"])
def test_short_secret_is_refused(
    keys: Path, keyring: Keyring, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_key(keys / "box-1.secret", text)
    assert keyring.secret_for("box-1") is None
    [warning] = warnings_of(caplog)
    assert "at least 32" in warning
    assert "keygen --keyring" in warning


@posix_only
def test_unreadable_key_file_is_refused(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    write_key(keys / "box-1.secret", mode=0o000)
    assert keyring.secret_for("box-1") is None
    assert "cannot open" in warnings_of(caplog)[0]


def test_vanished_directory_warns_once(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    keys.rmdir()
    for _ in range(3):
        assert keyring.secret_for("box-1") is None
    [warning] = warnings_of(caplog)
    assert "keyring directory is gone" in warning


# --------------------------------------------------------------------------- the directory


def test_missing_directory_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist.*keygen --keyring"):
        Keyring(tmp_path / "nope")


def test_file_as_directory_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a directory"):
        Keyring(write_key(tmp_path / "file"))


@posix_only
def test_world_writable_directory_refused_at_construction(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    keys.chmod(0o777)
    with pytest.raises(ConfigError, match=r"writable by everyone.*chmod o-w"):
        Keyring(keys)
    inner = keys / "inner"  # private itself, but below a directory anyone may write
    inner.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="writable by everyone"):
        Keyring(inner)


@posix_only
def test_own_sticky_world_writable_directory_is_accepted(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    keys.chmod(0o1777)
    assert Keyring(keys).directory == keys


def test_directory_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "keys").mkdir()
    monkeypatch.chdir(tmp_path)
    ring = Keyring("keys")
    assert ring.directory == tmp_path / "keys"
    assert "keys" in repr(ring)


# --------------------------------------------------------------------------- enrolled()


def test_enrolled_lists_only_well_named_regular_key_files(
    tmp_path: Path, keys: Path, keyring: Keyring
) -> None:
    for name in ("b-2", "a_1", "c.3"):
        enroll(keys, name)
    write_key(keys / ".hidden.secret")
    write_key(keys / "has space.secret")
    write_key(keys / "notes.txt")
    write_key(keys / ".secret")
    (keys / "dir.secret").mkdir()
    (keys / "link.secret").symlink_to(write_key(tmp_path / "t.secret"))
    assert keyring.enrolled() == ["a_1", "b-2", "c.3"]


def test_enrolled_scans_a_bounded_number_of_entries(
    keys: Path, keyring: Keyring, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from garcon_link.settings import keyring as module

    monkeypatch.setattr(module, "MAX_ENROLLED_SCAN", 5)
    for index in range(8):
        write_key(keys / f"box-{index}.secret")
    assert len(keyring.enrolled()) == 5
    assert "more than 5 entries" in warnings_of(caplog)[0]
    assert MAX_ENROLLED_SCAN == 100_000


def test_enrolled_of_a_vanished_directory_is_empty(
    keys: Path, keyring: Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    keys.rmdir()
    assert keyring.enrolled() == []
    assert "cannot list the keyring" in warnings_of(caplog)[0]


# --------------------------------------------------------------------------- enroll()


def test_enroll_creates_a_private_directory_and_key(tmp_path: Path) -> None:
    keys = tmp_path / "new" / "keys"
    path = enroll(keys, "box-1")
    assert path == keys / "box-1.secret"
    if POSIX:
        assert stat.S_IMODE(keys.stat().st_mode) & 0o077 == 0
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_secret_file(path)) == 32
    assert Keyring(keys).secret_for("box-1") == read_secret_file(path)


def test_enroll_refuses_overwrite_unless_forced(keys: Path) -> None:
    path = enroll(keys, "box-1")
    first = path.read_bytes()
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        enroll(keys, "box-1")
    assert path.read_bytes() == first
    enroll(keys, "box-1", force=True)
    assert path.read_bytes() != first


@pytest.mark.parametrize("value", ["../x", "box:1", "caf\u00e9", ".hidden", "", "a/b"])
def test_enroll_refuses_bad_ids_with_the_fix(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        enroll(tmp_path / "keys", value)
    message = str(info.value)
    assert "still loads its config" in message
    assert "rename" in message
    assert not (tmp_path / "keys").exists()
    assert list(tmp_path.iterdir()) == []


@posix_only
def test_enroll_refuses_an_unsafe_directory(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    keys.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by everyone"):
        enroll(keys, "box-1")
    assert not (keys / "box-1.secret").exists()
