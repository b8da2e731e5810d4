"""The shape of the tree: imports go one way, no module-level import cycle, modules
stay small (a longer one says why at its top)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("smb_protocol", "smb_client", "smb_server", "smb_train")
MAX_LINES = 400
REASON = "longer than"  # a module over MAX_LINES says "... longer than ..." in its docstring


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


def runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of ours imported when ``name`` is imported (not under TYPE_CHECKING, not
    inside functions)."""
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
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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
            bad = {m for m in runtime_imports(name, path, set(mods)) if m.startswith("smb_server")}
            assert not bad, f"{name} imports {bad}"


def test_no_module_level_import_cycle():
    mods = modules()
    graph = {name: runtime_imports(name, path, set(mods)) for name, path in mods.items()}
    # a package's __init__ importing its own submodules (a registry) is not a cycle
    for name in graph:
        graph[name] = {m for m in graph[name] if not (m.startswith(name + ".") and
                                                      mods[name].name == "__init__.py")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2
    for node in sorted(graph):
        if node not in state:
            dfs(node)


def test_modules_stay_small_or_say_why():
    long = []
    for name, path in modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if REASON not in doc:
                long.append(f"{name} ({text.count(chr(10))} lines)")
    assert not long, f"over {MAX_LINES} lines without a reason in the docstring: {', '.join(long)}"
