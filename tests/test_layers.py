"""Rooms with walls: the package's layers, their order, and the import rule, read from the source.

:data:`ROOMS` is the one table of the layers, bottom first. The rule, checked on every module of
``garcon_link`` by reading its imports with :mod:`ast` (nothing is imported or run):

* **no upward import**: a module imports only modules of its own room or of rooms below it;
* **no cycle** between modules (within a room too);
* **private stays in its room**: a module named ``_x`` and a name ``_x`` (not a ``__dunder__``)
  are imported only from inside their own room.

Every import counts the same: at module level, inside a function (a late import does not make
an upward arrow acceptable), and under ``if TYPE_CHECKING:`` -- a type-only import that points
up still says that a lower room knows an upper one, so it is refused too; what a lower room
needs from an upper one is passed in, or is a Protocol of the lower room. Importing
``pkg.mod`` runs ``pkg/__init__.py`` first; that implicit import is not an edge (the room
packages' ``__init__`` modules import nothing).

The layer diagram of docs/explanation/layers.md is checked against the same table: the rooms in
order, top first, each listing exactly its modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "garcon_link"
ROOT = Path(__file__).resolve().parent.parent
LAYERS_PAGE = ROOT / "docs" / "explanation" / "layers.md"


@dataclass(frozen=True, slots=True)
class Room:
    """One layer. ``members``: module names, or ``pkg.*`` for a package and all below it."""

    name: str
    members: tuple[str, ...]
    folder: bool  # its modules live in one folder named after it (else top-level modules)


ROOMS: tuple[Room, ...] = (
    Room(
        "ground",
        ("garcon_link.errors", "garcon_link.limits", "garcon_link.logs", "garcon_link.version"),
        False,
    ),
    Room("core", ("garcon_link.core.*",), True),
    Room("net", ("garcon_link.net.*",), True),
    Room("settings", ("garcon_link.settings.*",), True),
    Room("endpoint", ("garcon_link.endpoint.*",), True),
    Room("rpc", ("garcon_link.rpc.*",), True),
    Room("api", ("garcon_link.api.*",), True),
    Room(
        "apps",
        (
            "garcon_link",
            "garcon_link.__main__",
            "garcon_link._scaffold",
            "garcon_link.cli.*",
            "garcon_link.demo",
            "garcon_link.testing",
            "garcon_link.contrib.*",
            "garcon_link.services.*",
        ),
        False,
    ),
)


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module, or one name imported from a module, in one source line."""

    source: str  # the importing module
    line: int
    target: str  # the module the import reaches
    name: str | None  # the name taken from it (``from target import name``), if any


# ------------------------------------------------------------------------------ reading


def discover(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``): dotted name -> file."""
    modules: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: Mapping[str, Path], package: str) -> list[Import]:
    """Every import of ``package`` in ``path``, at any depth of the tree (functions and
    ``TYPE_CHECKING`` blocks included), resolved to the module it reaches."""
    is_package = path.name == "__init__.py"
    here = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [
                Import(module, node.lineno, alias.name, None)
                for alias in node.names
                if alias.name == package or alias.name.startswith(package + ".")
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != package and not target.startswith(package + "."):
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in modules:  # ``from pkg import mod``: the module itself
                    found.append(Import(module, node.lineno, submodule, None))
                else:
                    found.append(Import(module, node.lineno, target, alias.name))
    return found


def room_of(module: str, rooms: Iterable[Room]) -> Room | None:
    for room in rooms:
        for member in room.members:
            if member.endswith(".*"):
                stem = member[:-2]
                if module == stem or module.startswith(stem + "."):
                    return room
            elif module == member:
                return room
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ------------------------------------------------------------------------------ the rule


def violations(root: Path, package: str, rooms: tuple[Room, ...]) -> list[str]:
    """What breaks the rule in ``package``, one line each (empty when it holds)."""
    modules = discover(root, package)
    rank = {room.name: index for index, room in enumerate(rooms)}
    problems: list[str] = []
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        home = room_of(module, rooms)
        if home is None:
            problems.append(f"{module}: in no room; add it to ROOMS (tests/test_layers.py)")
            continue
        for imp in imports_of(module, path, modules, package):
            where = f"{module}:{imp.line}"
            what = imp.target + (f".{imp.name}" if imp.name else "")
            if imp.target not in modules:
                problems.append(f"{where}: imports {what}, which is not a module of {package}")
                continue
            if imp.target != module:
                graph[module].add(imp.target)
            there = room_of(imp.target, rooms)
            if there is None or there is home:
                continue
            if rank[there.name] > rank[home.name]:
                problems.append(f"{where}: upward import of {what} ({home.name} -> {there.name})")
            hidden = [part for part in imp.target.split(".") if _private(part)]
            if hidden or (imp.name is not None and _private(imp.name)):
                problems.append(f"{where}: imports {what}, private to the room {there.name}")
    for cycle, component in cycles(graph):
        others = sorted(component - set(cycle))
        more = f" (the circle also holds {', '.join(others)})" if others else ""
        problems.append(f"import cycle: {' -> '.join(cycle)}{more}")
    return problems


def cycles(graph: Mapping[str, set[str]]) -> Iterator[tuple[list[str], set[str]]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component that has one, with
    the component (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    for component in components:
        yield _cycle_in(set(component), graph), set(component)


def _cycle_in(component: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    """A shortest cycle through the first module of ``component`` (breadth first)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return [*paths[node], start]
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    following.append(succ)
        frontier = following
    raise AssertionError("a strongly connected component without a cycle")


# ------------------------------------------------------------------------------ the layers page


def diagram_units(
    rooms: tuple[Room, ...], modules: Mapping[str, Path]
) -> list[tuple[str, list[str]]]:
    """What the layers page's diagram must list, top room first: ``(room heading, units)``, where a
    unit is a file (``ws.py``, relative to the room's folder or the package) or a subpackage
    of a top-level room (``services/``); a room folder's ``__init__.py`` is the room itself."""
    listed: dict[str, set[str]] = {room.name: set() for room in rooms}
    for module, path in modules.items():
        room = room_of(module, rooms)
        assert room is not None, module
        parts = module.split(".")[1:]
        if room.folder:
            parts = parts[1:]
        if not parts:
            continue  # the room's own package (or the package face: listed as __init__.py)
        subpackage = len(parts) > 1 or path.name == "__init__.py"
        listed[room.name].add(parts[0] + ("/" if subpackage else ".py"))
    listed["apps"].add("__init__.py")
    return [
        (f"{room.name}/" if room.folder else room.name, sorted(listed[room.name]))
        for room in reversed(rooms)
    ]


_UNIT = r"[\w]+(?:\.py|/)"
_UNITS = re.compile(rf"^  ({_UNIT}(?:, {_UNIT})*)(?:\s|$)")


def readme_diagram(text: str) -> list[tuple[str, list[str]]]:
    """The rooms and units the layers page's diagram (its first code block) lists, top first: a
    heading is a line in column 0 (its first word), units are the file names that start an
    indented line."""
    section = text[text.index("# Layers\n") :]
    block = section[section.index("```\n") + 4 :]
    block = block[: block.index("```")]
    found: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            found.append((line.split()[0], []))
            continue
        match = _UNITS.match(line)
        if match:
            assert found, f"a module before the first room: {line!r}"
            found[-1][1].extend(match.group(1).split(", "))
    return [(room, sorted(units)) for room, units in found]


# ------------------------------------------------------------------------------ the tests


def test_every_import_follows_the_rooms() -> None:
    problems = violations(ROOT, PACKAGE, ROOMS)
    assert not problems, "\n".join(problems)


SANS_IO_ROOMS = ("ground", "core")
"""Rooms that do no I/O and read no clock: bytes and values in, bytes and values out."""
IO_MODULES = frozenset({"anyio", "asyncio", "trio", "socket", "ssl", "select", "time", "threading"})
CLOCK_READERS = {"garcon_link.logs": {"time"}}
"""Ground modules allowed one of those: ``logs`` writes log records (I/O through the handlers the
application configures), and its rate limiter reads the monotonic clock unless one is injected."""


def test_the_sans_io_rooms_import_no_event_loop_socket_or_clock() -> None:
    found = []
    for module, path in discover(ROOT, PACKAGE).items():
        room = room_of(module, ROOMS)
        if room is None or room.name not in SANS_IO_ROOMS:
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            found += [
                f"{module}:{node.lineno}: {name}"
                for name in names
                if name.partition(".")[0] in IO_MODULES
                and name.partition(".")[0] not in CLOCK_READERS.get(module, set())
            ]
    assert not found, "\n".join(found)


def test_the_layers_page_diagram_lists_the_rooms_in_order_with_their_modules() -> None:
    expected = diagram_units(ROOMS, discover(ROOT, PACKAGE))
    assert readme_diagram(LAYERS_PAGE.read_text("utf-8")) == expected, (
        "docs/explanation/layers.md: its diagram must list each room's modules"
    )


TRANSPORT_PARTS: Mapping[str, frozenset[str]] = {
    "garcon_link.endpoint._shared": frozenset(),
    "garcon_link.endpoint._watches": frozenset({"garcon_link.endpoint._shared"}),
    "garcon_link.endpoint._outbound": frozenset({"garcon_link.endpoint._shared"}),
    "garcon_link.endpoint._delivery": frozenset(
        {
            "garcon_link.endpoint._shared",
            "garcon_link.endpoint._outbound",
            "garcon_link.endpoint._watches",
        }
    ),
    "garcon_link.endpoint._inbound": frozenset(
        {
            "garcon_link.endpoint._shared",
            "garcon_link.endpoint._delivery",
            "garcon_link.endpoint._outbound",
            "garcon_link.endpoint._watches",
        }
    ),
    "garcon_link.endpoint.transport": frozenset(
        {
            "garcon_link.endpoint._shared",
            "garcon_link.endpoint._delivery",
            "garcon_link.endpoint._inbound",
            "garcon_link.endpoint._outbound",
            "garcon_link.endpoint._watches",
        }
    ),
}
"""The SessionTransport's parts (docs/design.md#transport), each with the parts it may import: the
owner imports its parts and what they share; the reader (inbound) hands payloads to the delivery
and tells the outbound side and the watches what it read; the delivery holds writes during a
hand-over (outbound) and pauses the replay clock while it waits (watches); the outbound side and
the watches know only the shared state."""


def part_violations(root: Path, package: str, parts: Mapping[str, frozenset[str]]) -> list[str]:
    """Where the parts of ``parts`` break their walls, one line each: an import of a part not
    listed for it, or an attribute with a private name (``x._y``, not a ``__dunder__``) reached on
    anything but ``self`` -- one part uses another only through its public names."""
    modules = discover(root, package)
    problems: list[str] = []
    for module, allowed in parts.items():
        path = modules[module]
        for imp in imports_of(module, path, modules, package):
            if imp.target in parts and imp.target != module and imp.target not in allowed:
                problems.append(f"{module}:{imp.line}: imports the part {imp.target}")
        for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")
            ):
                problems.append(f"{module}:{node.lineno}: reaches {ast.unparse(node)}")
    return problems


def test_the_transport_parts_keep_to_their_walls() -> None:
    problems = part_violations(ROOT, PACKAGE, TRANSPORT_PARTS)
    assert not problems, "\n".join(problems)


LINK_PARTS: Mapping[str, frozenset[str]] = {
    "garcon_link.endpoint._arguments": frozenset(),
    "garcon_link.endpoint._slots": frozenset(),
    "garcon_link.endpoint._handshaking": frozenset(),
    "garcon_link.endpoint._dialing": frozenset(),
    "garcon_link.endpoint._executor_link": frozenset(),
    "garcon_link.endpoint._failures": frozenset(),
    "garcon_link.endpoint._places": frozenset({"garcon_link.endpoint._slots"}),
    "garcon_link.endpoint._admitting": frozenset(
        {"garcon_link.endpoint._places", "garcon_link.endpoint._slots"}
    ),
    "garcon_link.endpoint._attaching": frozenset(
        {"garcon_link.endpoint._heartbeat", "garcon_link.endpoint._slots"}
    ),
    "garcon_link.endpoint._authenticating": frozenset(
        {
            "garcon_link.endpoint._admitting",
            "garcon_link.endpoint._attaching",
            "garcon_link.endpoint._handshaking",
            "garcon_link.endpoint._slots",
        }
    ),
}
"""Parts of the WebSocketLink (docs/design.md#link), each with the link parts it may import: a
slot knows no other part; the places add slots; the admission reads the slots and the places;
the attachments run a slot's socket with its heartbeat; the authentication hands a socket from
the handshaker to the admission and returns its attachment; the argument checks, the handshaker and
the dialer know no other part (they reach the link only through the callables it gives them),
nor do the executor's view (it reads the link through a Protocol) and the failures (the latest
cause, the mapping of an unexpected exception) every part reports to.
The link imports every part; a part importing the link would be a cycle (refused above). The
heartbeat is not listed: its timer object reads its Heartbeat's private fields, in one module."""


def test_the_link_parts_keep_to_their_walls() -> None:
    problems = part_violations(ROOT, PACKAGE, LINK_PARTS)
    assert not problems, "\n".join(problems)


_S = "garcon_link.services."
PROCESS_PARTS: Mapping[str, frozenset[str]] = {
    _S + "_process_values": frozenset(),
    _S + "_process_args": frozenset(),
    _S + "_spool": frozenset({_S + "_process_values"}),
    _S + "_supervisor": frozenset({_S + "_process_values", _S + "_spool"}),
    _S + "_records": frozenset({_S + "_process_values"}),
    _S + "_ledger": frozenset({_S + "_process_values", _S + "_records", _S + "_supervisor"}),
    _S + "_process_table": frozenset(
        {_S + "_ledger", _S + "_process_values", _S + "_records", _S + "_supervisor"}
    ),
}
"""Parts of the process service (garcon_link/services/process.py), each with the parts it may
import: the values and the argument checks know no other part; a spool makes output chunks; a
supervisor runs a process group with its spools; the rows of the state directory are values;
the ledger keeps those rows for the service's supervised processes and restores them; the
table holds the supervised processes and counts the ledger's restored records with them. The
service imports its parts; none imports the service (a cycle, refused above)."""


def test_the_process_service_parts_keep_to_their_walls() -> None:
    problems = part_violations(ROOT, PACKAGE, PROCESS_PARTS)
    assert not problems, "\n".join(problems)


_A = "garcon_link.api."
GATEWAY_PARTS: Mapping[str, frozenset[str]] = {
    _A + "_relay_wire": frozenset(),
    _A + "_relay_executor": frozenset({_A + "_relay_wire"}),
    _A + "_admission": frozenset({_A + "_framing"}),
    _A + "_shares": frozenset(),
    _A + "_caller_stats": frozenset(),
    _A + "_framing": frozenset(),
    _A + "_watches": frozenset({_A + "_admission", _A + "_relay_wire"}),
    _A + "_forwarding": frozenset(
        {
            _A + "_admission",
            _A + "_caller_stats",
            _A + "_framing",
            _A + "_relay_wire",
            _A + "_shares",
        }
    ),
    _A + "_relaying": frozenset(
        {
            _A + "_admission",
            _A + "_caller_stats",
            _A + "_forwarding",
            _A + "_relay_wire",
            _A + "_shares",
            _A + "_watches",
        }
    ),
    _A + "gateway": frozenset(
        {
            _A + "_admission",
            _A + "_caller_stats",
            _A + "_forwarding",
            _A + "_framing",
            _A + "_relay_wire",
            _A + "_relaying",
            _A + "_shares",
            _A + "_watches",
        }
    ),
}
"""Parts of the gateway and of its callers' side (docs/design.md#gateway), each with the parts it
may import: the relay interface and outcomes (both sides read them), a caller's executor handle
(which encodes its calls with them); the gateway's shares, callers' counters and the reading of
a relay call's bytes, which know no other part; its admission, which frames a request's
arguments with that reading; what callers are shown of the fleet (their watches), which reads
the grants; the forward of a relayed call, which takes its caller's share, counts for its caller
and reads its arguments; the relay service, which runs a call's steps with all of those; and the
gateway, which builds them all. None reaches a private name of another object: what one needs of
RemoteExecutor, or of the fleet, it reads through their documented internal surface
(``Fleet.members``, ``Fleet.tap``, ``Fleet.host``, ``Fleet.retention``)."""


def test_the_gateway_parts_keep_to_their_walls() -> None:
    problems = part_violations(ROOT, PACKAGE, GATEWAY_PARTS)
    assert not problems, "\n".join(problems)


def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, "utf-8")


_TOY_ROOMS = (
    Room("low", ("toy.low.*",), True),
    Room("high", ("toy.high.*",), True),
    Room("apps", ("toy",), False),
)


def _toy(tmp_path: Path, **extra: str) -> list[str]:
    files = {
        "toy/__init__.py": "from .high import face\n",
        "toy/low/__init__.py": "",
        "toy/low/base.py": "VALUE = 1\n_HIDDEN = 2\n",
        "toy/low/_seam.py": "SEAM = 3\n",
        "toy/low/user.py": "from . import _seam\nfrom .base import _HIDDEN\n",
        "toy/high/__init__.py": "",
        "toy/high/face.py": "from ..low.base import VALUE\n",
    }
    files.update({name.replace("__", "/") + ".py": text for name, text in extra.items()})
    _write(tmp_path, files)
    return violations(tmp_path, "toy", _TOY_ROOMS)


def test_the_rule_holds_in_a_clean_toy_package(tmp_path: Path) -> None:
    assert _toy(tmp_path) == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        pytest.param(
            "toy__low__late",
            "def f():\n    from ..high.face import VALUE\n",
            "toy.low.late:2: upward import of toy.high.face.VALUE (low -> high)",
            id="upward-in-a-function",
        ),
        pytest.param(
            "toy__low__typed",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import toy.high.face\n",
            "toy.low.typed:3: upward import of toy.high.face (low -> high)",
            id="upward-type-only",
        ),
        pytest.param(
            "toy__high__peek",
            "from ..low.base import _HIDDEN\n",
            "toy.high.peek:1: imports toy.low.base._HIDDEN, private to the room low",
            id="private-name",
        ),
        pytest.param(
            "toy__high__seam",
            "from ..low import _seam\n",
            "toy.high.seam:1: imports toy.low._seam, private to the room low",
            id="private-module",
        ),
    ],
)
def test_the_rule_refuses_each_kind_of_breach(
    tmp_path: Path, module: str, source: str, expected: str
) -> None:
    assert _toy(tmp_path, **{module: source}) == [expected]


def test_a_cycle_is_refused_even_inside_one_room(tmp_path: Path) -> None:
    problems = _toy(
        tmp_path,
        toy__low__base="from .user import X\n",
        toy__low__user="X = 1\nfrom .base import VALUE\n",
    )
    assert problems == ["import cycle: toy.low.base -> toy.low.user -> toy.low.base"]


def test_a_module_outside_every_room_is_reported(tmp_path: Path) -> None:
    assert _toy(tmp_path, toy__extra="") == [
        "toy.extra: in no room; add it to ROOMS (tests/test_layers.py)"
    ]


_TOY_PARTS = {
    "toy.low.base": frozenset(),
    "toy.low.user": frozenset({"toy.low.base"}),
}


@pytest.mark.parametrize(
    ("base", "user", "expected"),
    [
        pytest.param(
            "VALUE = 1\n",
            "from .base import VALUE\n",
            [],
            id="clean",
        ),
        pytest.param(
            "from .user import X\n",
            "X = 1\n",
            ["toy.low.base:1: imports the part toy.low.user"],
            id="unlisted-import",
        ),
        pytest.param(
            "class Side:\n    def __init__(self):\n        self._held = 0\n",
            "def peek(side):\n    return side._held\n",
            ["toy.low.user:2: reaches side._held"],
            id="private-attribute",
        ),
    ],
)
def test_the_part_rule_refuses_each_kind_of_breach(
    tmp_path: Path, base: str, user: str, expected: list[str]
) -> None:
    _write(tmp_path, {"toy/__init__.py": "", "toy/low/__init__.py": ""})
    _write(tmp_path, {"toy/low/base.py": base, "toy/low/user.py": user})
    assert part_violations(tmp_path, "toy", _TOY_PARTS) == expected


def test_the_diagram_check_sees_a_module_in_the_wrong_room() -> None:
    text = LAYERS_PAGE.read_text("utf-8")
    expected = diagram_units(ROOMS, discover(ROOT, PACKAGE))
    moved = re.sub(r"\n  ws\.py", "\n  wsx.py", text, count=1)
    assert readme_diagram(moved) != expected
