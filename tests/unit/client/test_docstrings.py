"""Every public function and method of the client library's public modules, and every
``__enter__``/``__exit__``, says in a docstring what it does (read from the source:
nothing is imported). Members of a ``Protocol`` are exempt: they name what the real
class, which documents them, must have."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "smb_client"
MODULES = ["client.py", "region.py", "collective.py", "coord.py", "futures.py", "aio.py",
           *(f"torch/{p.name}" for p in sorted((ROOT / "torch").glob("*.py")) if p.name != "__init__.py")]
DUNDERS = {"__enter__", "__exit__", "__aenter__", "__aexit__", "__await__"}


def undocumented(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out: list[str] = []

    def visit(body: list[ast.stmt], owner: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                if not any(ast.unparse(b).endswith("Protocol") for b in node.bases):
                    visit(node.body, f"{owner}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                public = not node.name.startswith("_") or node.name in DUNDERS
                if public and ast.get_docstring(node) is None:
                    where = path.relative_to(ROOT.parent) if path.is_relative_to(ROOT.parent) else path.name
                    out.append(f"{where}:{node.lineno} {owner}{node.name}")
    visit(tree.body, "")
    return out


def test_every_public_method_has_a_docstring():
    missing = [m for name in MODULES if (ROOT / name).exists() for m in undocumented(ROOT / name)]
    assert not missing, "no docstring:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_docstring(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('class A:\n    def f(self):\n        pass\n\n    def __exit__(self, *e):\n        """Close."""\n'
                   '\n    def _g(self):\n        pass\n\n\nclass P(Protocol):\n    def h(self): ...\n')
    assert [m.split()[-1] for m in undocumented(src)] == ["A.f"]
