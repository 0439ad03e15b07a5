"""Every error code garcon_link can return is documented in docs/reference/error-codes.md.

The codes are read from the source, not from a list kept by hand: every string given as the
code of a :class:`~garcon_link.errors.CallError` (the first argument or ``code=`` of one of its
classes, or of a function or class whose parameter ``code`` it becomes), including both
branches of a conditional, the values of a mapping it is looked up in, a module constant it
names, and a ``code`` parameter's default. The page's tables must list each in a row of its own
(`` | `CODE` | ``), with what it means and what to do; a row for a code the source no longer
contains fails too.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import garcon_link.errors as errors

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "garcon_link"
PAGE = ROOT / "docs" / "reference" / "error-codes.md"

ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]*)` \|([^|]*)\|([^|]*)\|([^|]*)\|$")
CODE = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")

CALL_ERRORS = frozenset(
    name
    for name, obj in vars(errors).items()
    if inspect.isclass(obj) and issubclass(obj, errors.CallError)
)


def _code_index(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int | None:
    names = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return names.index("code") if "code" in names else None


def _strings(node: ast.AST, scope: dict[str, ast.AST]) -> list[str]:
    """The strings ``node`` can evaluate to, as far as the source says."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, scope) + _strings(node.orelse, scope)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        table = scope.get(node.value.id)
        if isinstance(table, ast.Dict):
            return [s for value in table.values for s in _strings(value, scope)]
    if isinstance(node, ast.Name):
        bound = scope.get(node.id)
        if isinstance(bound, ast.Constant):
            return _strings(bound, scope)
    return []


def codes_in_source() -> dict[str, set[str]]:
    """``{code: {where}}`` for every code the package gives a CallError."""
    trees = {path: ast.parse(path.read_text("utf-8")) for path in PACKAGE.rglob("*.py")}
    takes: dict[str, int] = {}  # a function's or class's name -> position of its ``code``
    found: dict[str, set[str]] = {}

    def add(code: str, path: Path, node: ast.AST) -> None:
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        found.setdefault(code, set()).add(where)

    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        index = _code_index(item)
                        if index is not None:
                            takes[node.name] = index
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                index = _code_index(node)
                if index is not None and node.name != "__init__":
                    takes[node.name] = index
                params = [*node.args.posonlyargs, *node.args.args]
                first = len(params) - len(node.args.defaults)
                defaults = zip(params[first:], node.args.defaults, strict=True)
                for param, default in defaults:
                    if param.arg == "code":
                        for code in _strings(default, {}):
                            add(code, path, node)
    for path, tree in trees.items():
        scope: dict[str, ast.AST] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    scope[target.id] = node.value
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            keywords = {k.arg: k.value for k in node.keywords}
            index = 0 if name in CALL_ERRORS else takes.get(name) if name is not None else None
            if index is None:
                given = keywords.get("code")
            else:
                given = node.args[index] if len(node.args) > index else keywords.get("code")
            if given is None:
                continue
            for code in _strings(given, scope):
                if CODE.fullmatch(code):
                    add(code, path, node)
    return found


def documented() -> dict[str, list[str]]:
    """``{code: [its row's cells]}`` from the page's tables."""
    rows: dict[str, list[str]] = {}
    for line in PAGE.read_text("utf-8").splitlines():
        match = ROW.match(line)
        if match:
            code = match.group(1)
            assert code not in rows, f"{PAGE.name}: {code} has two rows"
            rows[code] = [cell.strip() for cell in match.groups()[1:]]
    return rows


def test_the_source_scan_finds_codes_of_every_kind() -> None:
    """The scan itself: a constant argument, a conditional, a mapping, a module constant, a
    default, and a helper that passes its ``code`` on."""
    found = codes_in_source()
    for code in (
        "OFFLINE",  # NotDispatched("OFFLINE", ...)
        "PROCESS_DETACHED",  # "OUTPUT_LOST" if ... else "PROCESS_DETACHED"
        "DIRECTORY_NOT_EMPTY",  # Rejected(rejected[code]) with rejected = {errno...: ...}
        "HOOK_FAILED",  # Rejected(HOOK_FAILED, ...) with HOOK_FAILED = "HOOK_FAILED"
        "STALE_RESOURCE",  # StaleResource(code="STALE_RESOURCE")
        "FLOW_CONTROL_VIOLATION",  # self._end_stream(pending, "FLOW_CONTROL_VIOLATION", ...)
        "CONTRACT_CHANGED",  # _Refusal("CONTRACT_CHANGED", ...)
    ):
        assert code in found, code
    assert len(found) >= 60, sorted(found)


def test_every_code_the_library_returns_is_documented() -> None:
    found = codes_in_source()
    rows = documented()
    missing = {code: sorted(where)[:3] for code, where in found.items() if code not in rows}
    assert not missing, (
        f"codes the library returns that {PAGE.relative_to(ROOT)} does not list (add a row: "
        f"code, exception, what it means, what to do): {missing}"
    )


def test_every_documented_code_is_one_the_library_returns() -> None:
    """A row for a code the source no longer contains is stale (codes only hooks and statistics
    report, such as ``LOCAL_ERROR``, are in the source as text too)."""
    source = "\n".join(path.read_text("utf-8") for path in PACKAGE.rglob("*.py"))
    stale = [code for code in documented() if f'"{code}"' not in source]
    assert not stale, f"{PAGE.relative_to(ROOT)} lists codes the library never returns: {stale}"


def test_every_row_says_what_it_means_and_what_to_do() -> None:
    for code, (raised_as, meaning, todo) in documented().items():
        assert raised_as and meaning and todo, f"{code}: an empty cell"
