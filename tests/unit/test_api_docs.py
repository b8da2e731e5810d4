"""The API reference (`make api-docs`, tools/api_docs.py): it builds with no warning,
has an entry for every public class, function and method of the client library's
public modules, and shows real signatures: no bare ``**kwargs`` where the options are
known."""
from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import api_docs  # noqa: E402

pytest.importorskip("torch")

# public callables whose ``**`` parameter is open-ended, with why
OPEN_ENDED = {
    "smb_client.torch.DistributedDataParallel.forward": "the wrapped module's own arguments",
    "smb_client.torch.ParameterStore.save": "values of the caller's own saved beside the weights (step=...)",
    **{f"smb_client.torch.SMBProcessGroup.{op}": "not supported: raises UnsupportedOperation, whatever torch passes"
       for op in ("reduce", "gather", "scatter", "alltoall", "all_to_all_single", "send", "recv", "recv_anysource")},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("api")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "api_docs.py"), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and not proc.stderr, f"the API reference build warned:\n{proc.stderr}"
    return out


def page(reference: Path, module: str) -> str:
    return (reference / (module.replace(".", "/") + ".html")).read_text()


def public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and getattr(v, "__module__", "") == module.__name__]
    return sorted(names)


def own_methods(cls: type) -> dict[str, Any]:
    """The public methods and properties ``cls`` defines itself (not inherited, not
    made by ``typing`` or ``enum``), with ``__init__``."""
    out = {}
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(fn) and fn.__module__.startswith(("smb_client", "smb_protocol")):
            out[name] = value
    return out


def documented() -> list[tuple[str, str, Any]]:
    """(module, qualified name, object) of every public class, function and method."""
    out = []
    for modname in (*api_docs.MODULES, "smb_client.errors"):
        module = importlib.import_module(modname)
        for name in public_names(module):
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue
            out.append((modname, name, obj))
            if inspect.isclass(obj):
                out += [(modname, f"{name}.{m}", v) for m, v in own_methods(obj).items()]
    return out


def test_the_reference_builds_without_warnings_and_names_everything(reference):
    missing = []
    for modname, qualname, _ in documented():
        if f'id="{qualname}"' not in page(reference, modname):
            missing.append(f"{modname}.{qualname}")
    assert not missing, "not in the API reference:\n" + "\n".join(missing)
    assert (reference / "index.html").exists()


def test_signatures_name_their_options():
    bare = []
    for modname, qualname, obj in documented():
        fn = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
        if not callable(fn) or inspect.isclass(fn):
            continue
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in params) and f"{modname}.{qualname}" not in OPEN_ENDED:
            bare.append(f"{modname}.{qualname}{inspect.signature(fn)}")
    assert not bare, "options hidden behind **:\n" + "\n".join(bare)


@pytest.mark.parametrize("module, entry, shown", [
    ("smb_client", "connect", ["transport", "connections", "tls"]),
    ("smb_client.torch", "job", ["checkpoint", "scheme", "placement", "replicas"]),
    ("smb_client.torch", "Job.seasgd", ["moving_rate", "update_interval", "keep_deltas"]),
    ("smb_client.torch", "Job.sync", ["bucket_bytes", "compression"]),
    ("smb_client.torch", "open_store", ["members", "scheme", "workers", "lease"]),
    ("smb_client.torch.weights", "publisher", ["versions", "ranks"]),
])
def test_the_reference_shows_the_options(reference, module, entry, shown):
    html = page(reference, module)
    start = html.index(f'id="{entry}"')
    signature = re.sub(r"<[^>]+>", "", html[start:html.index("</div>", start)])
    for name in shown:
        assert f"{name}:" in signature, f"{module}.{entry} shows no {name}: {signature}"
