"""Build the client library's API reference from its docstrings with pdoc (`make api-docs`).

    python tools/api_docs.py [OUTPUT]      # default build/api; open OUTPUT/index.html

The reference covers the modules of :data:`MODULES`: every name in a module's
``__all__`` (every public name where there is none), each class with its public
methods and each function with its real signature. The build fails (exit status 1) on
any warning pdoc gives, so that the test that runs it (tests/unit/test_api_docs.py)
catches a docstring or an annotation pdoc cannot read.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = ROOT / "build" / "api"

# the modules a user imports from (README.md and docs/ name no others); pdoc adds the
# submodules a package's __all__ names (smb_client.errors, the exception tree)
MODULES = (
    "smb_client",                # Client, Region, Collective, Barrier, Lock, Publisher, Subscriber, connect
    "smb_client.coord",          # barriers and locks over regions, controller_barrier
    "smb_client.metrics",        # the client's own latency histograms
    "smb_client.weights",        # weights from a trainer to many readers
    "smb_client.torch",          # ParameterStore, the three schemes, job(), the DDP wrapper, the backend
    "smb_client.torch.weights",  # the same for torch modules
)


def build(output: Path) -> list[str]:
    """Write the reference of :data:`MODULES` under ``output``; returns pdoc's warnings
    (empty when the build is clean)."""
    sys.path.insert(0, str(ROOT))
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="restructuredtext", show_source=False,
                          footer_text="Soft Memory Box client library")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*MODULES, output_directory=output)
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]


def main(argv: list[str]) -> int:
    """Build into ``argv[0]`` (default :data:`DEFAULT_OUTPUT`); 1 when pdoc warned."""
    output = Path(argv[0]) if argv else DEFAULT_OUTPUT
    problems = build(output)
    for p in problems:
        print(f"api-docs: {p}", file=sys.stderr)
    if problems:
        print(f"api-docs: {len(problems)} warning(s); the reference under {output} is incomplete", file=sys.stderr)
        return 1
    print(f"api-docs: {output / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
