"""The shape of the tree: imports go one way, no import cycle (not even one that only
type checkers follow), modules stay small (a longer one is named below, with why)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("smb_protocol", "smb_client", "smb_server", "smb_train")
MAX_LINES = 400   # a module longer than this is named in LONG_MODULES, with its reason
HARD_CAP = 600    # no module is longer than this, named or not

# module -> why it is longer than MAX_LINES (one line each; drop an entry once it fits)
LONG_MODULES: dict[str, str] = {
    "smb_protocol.placement": "the layouts, their server planner and the share math behind its weights are one "
                              "pure unit the controller and the client share",
    "smb_client.client": "the public Client: every control-plane call, each with its typed result and its "
                         "documented errors",
    "smb_server.controller.repair": "the sequences of a repair pass keep their ordering rules (store before "
                                    "servers, backups before a new primary) in one place",
    "smb_server.memserver.tcp_plane": "a connection's framing, deadlines, greeting, parting answers and TLS "
                                      "share one socket and one set of limits (operations are the engine's)",
    "smb_server.memserver.replication": "a replica set's configuration, forwarding, sync and the wait for a failed "
                                        "backup share one condition and one set of states",
}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if "_proto" in path.parts:
                continue
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def runtime_imports(name: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """Modules of ours imported at module level by ``name`` (not inside functions);
    with ``type_checking`` those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        base = package.split(".")
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) \
                    and not type_checking:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node.module, node.level)
                found.add(base)
                for alias in node.names:
                    found.add(f"{base}.{alias.name}")
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(tree.body)
    return {m for m in found if m in known and m != name}


def test_smb_client_never_imports_smb_server():
    mods = modules()
    for name, path in mods.items():
        if name.startswith("smb_client"):
            bad = {m for m in runtime_imports(name, path, set(mods), type_checking=True)
                   if m.startswith("smb_server")}
            assert not bad, f"{name} imports {bad}"


def all_imports(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_benchmarks_import_nothing_from_the_tests():
    bad = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        named = {m for m in all_imports(path) if m == "tests" or m.startswith("tests.")}
        if named:
            bad[str(path.relative_to(ROOT))] = named
    assert not bad, f"bench/ stands on tests/ (move what it needs into smb_server.testing): {bad}"


def test_only_tests_and_benchmarks_use_the_testing_harness():
    mods = modules()
    for name, path in mods.items():
        if not name.startswith("smb_server.testing"):
            bad = {m for m in runtime_imports(name, path, set(mods), type_checking=True)
                   if m.startswith("smb_server.testing")}
            assert not bad, f"{name} imports {bad}"


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or around a circle
    (the strongly connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_import_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert import_cycles(graph) == [["a", "b", "c"], ["e", "f"]]


def test_no_import_cycle_even_under_type_checking():
    mods = modules()
    graph = {name: runtime_imports(name, path, set(mods), type_checking=True) for name, path in mods.items()}
    # a package's __init__ importing its own submodules (a registry) is not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") and
                                                      mods[name].name == "__init__.py")}
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_modules_stay_small_or_say_why():
    mods = modules()
    lines = {name: path.read_text().count("\n") for name, path in mods.items()}
    too_long = [f"{name} ({n} lines)" for name, n in sorted(lines.items()) if n > HARD_CAP]
    assert not too_long, f"over the hard cap of {HARD_CAP} lines: {', '.join(too_long)}"
    unnamed = [f"{name} ({n} lines)" for name, n in sorted(lines.items())
               if n > MAX_LINES and name not in LONG_MODULES]
    assert not unnamed, f"over {MAX_LINES} lines and not in LONG_MODULES: {', '.join(unnamed)}"
    stale = [name for name in sorted(LONG_MODULES) if lines.get(name, 0) <= MAX_LINES]
    assert not stale, f"in LONG_MODULES but gone or no longer over {MAX_LINES} lines: {', '.join(stale)}"
    assert all(reason.strip() and "\n" not in reason for reason in LONG_MODULES.values())
