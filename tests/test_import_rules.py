"""Import rules of the house (STYLE.md): ``protocol`` is pure (numpy + msgspec, no sockets,
threads, clocks or torch) and imports neither other package; ``dspark_client`` and
``dspark_worker`` never import each other; the vLLM plugin ``dspark_vllm`` builds on the
client (never the worker), nothing else imports it, and loading it as vLLM's plugin imports
neither vLLM nor torch; the SGLang plugin ``dspark_sglang`` likewise builds on the client and
nothing imports it. Checked on the source (AST) and, for torch, by importing in a fresh
interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# I/O, concurrency and clocks belong to the worker and the client, never to the contract.
PROTOCOL_FORBIDDEN = {"socket", "asyncio", "threading", "time", "torch", "select", "selectors",
                      "multiprocessing", "subprocess", "dspark_worker", "dspark_client",
                      "dspark_vllm"}


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved to absolute names, including
    ``importlib.import_module("x")`` and ``__import__("x")`` with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    package = list(rel.parts[:-1])  # the package a module (or an __init__) sits in
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1
                if up > len(package):
                    out.add("<beyond the top package>")
                    continue
                base = package[:len(package) - up]
            else:
                base = []
            mod = [*base, *node.module.split(".")] if node.module else base
            out.add(".".join(mod))
            out.update(".".join([*mod, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str):
                out.add(arg.value)
    return out


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_the_scanner_sees_imports() -> None:
    """The rules below are only as good as the scan: check it on files with known imports."""
    wire = imported_modules(ROOT / "protocol" / "wire.py")
    assert {"protocol.constants", "protocol.framing", "protocol.messages"} <= wire
    assert "numpy" in imported_modules(ROOT / "protocol" / "messages.py")
    assert "hmac" in imported_modules(ROOT / "protocol" / "auth.py")


def test_protocol_files_exist() -> None:
    names = {p.name for p in sources("protocol")}
    assert {"__init__.py", "wire.py", "messages.py", "framing.py", "sampled.py", "validate.py",
            "identity.py", "auth.py"} <= names


@pytest.mark.parametrize("path", sources("protocol"), ids=lambda p: p.name)
def test_protocol_stays_pure(path: Path) -> None:
    bad = top_level(imported_modules(path)) & PROTOCOL_FORBIDDEN
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
    assert "<beyond the top package>" not in imported_modules(path)


@pytest.mark.parametrize("path", sources("protocol"), ids=lambda p: p.name)
def test_protocol_never_validates_with_assert(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert lines == [], f"{path.relative_to(ROOT)} uses assert at lines {lines}"


@pytest.mark.parametrize(("package", "other"), [("dspark_client", "dspark_worker"),
                                                ("dspark_worker", "dspark_client")])
def test_client_and_worker_never_import_each_other(package: str, other: str) -> None:
    files = sources(package)
    assert files, f"{package} has no sources"
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p)
                                                  if m.split(".")[0] == other)
                 for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize(("plugin", "package"), [
    ("dspark_vllm", "dspark_client"), ("dspark_vllm", "dspark_worker"),
    ("dspark_vllm", "dspark_sglang"), ("dspark_sglang", "dspark_client"),
    ("dspark_sglang", "dspark_worker"), ("dspark_sglang", "dspark_vllm")])
def test_nothing_imports_an_engine_plugin(plugin: str, package: str) -> None:
    """``dspark_vllm`` and ``dspark_sglang`` are imported only inside their engines (their
    plugin loaders)."""
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p)
                                                  if m.split(".")[0] == plugin)
                 for p in sources(package)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_vllm_plugin_builds_on_the_client_never_the_worker() -> None:
    files = sources("dspark_vllm")
    assert {"__init__.py", "config.py", "speculator.py"} <= {p.name for p in files}
    used = set().union(*(top_level(imported_modules(p)) for p in files))
    assert "dspark_worker" not in used
    assert {"dspark_client", "vllm", "torch"} <= used
    # vLLM imports speculator configs in every process: they must not import the speculator
    # (nor torch themselves), as vLLM's own config modules do not (speculator_config.py).
    modules = imported_modules(ROOT / "dspark_vllm" / "config.py")
    assert not {m for m in modules if m.startswith("dspark_vllm.speculator")}
    assert "torch" not in top_level(modules)


def test_the_sglang_plugin_builds_on_the_client_never_the_worker() -> None:
    files = sources("dspark_sglang")
    assert {"__init__.py", "algo.py", "worker.py"} <= {p.name for p in files}
    used = set().union(*(top_level(imported_modules(p)) for p in files))
    assert "dspark_worker" not in used and "dspark_vllm" not in used
    assert {"dspark_client", "sglang", "torch"} <= used
    # SGLang runs the entry point in every one of its processes: it imports nothing at the
    # top but the package's constants (SGLang's registry is imported inside register()).
    assert top_level(imported_modules(ROOT / "dspark_sglang" / "__init__.py")) <= {
        "__future__", "typing", "sglang", "dspark_sglang"}


def test_the_adapters_torch_module_is_for_the_adapters_only() -> None:
    """``dspark_client.adapter.device`` imports torch; nothing else in ``dspark_client``
    imports it (the client stays torch-free), and the adapters' other shared modules import
    neither torch nor an engine."""
    device = "dspark_client.adapter.device"
    offenders = sorted(str(p.relative_to(ROOT)) for p in sources("dspark_client")
                       if device in imported_modules(p))
    assert offenders == []
    for name in ("slots.py", "engine.py"):
        used = top_level(imported_modules(ROOT / "dspark_client" / "adapter" / name))
        assert not used & {"torch", "vllm", "sglang"}, name


def test_the_adapters_options_import_no_engine() -> None:
    """The options every engine adapter shares, and what it asks the worker before its HELLO,
    are checked without vLLM, SGLang or torch."""
    for name in ("options.py", "worker.py"):
        module = ROOT / "dspark_client" / "adapter" / name
        assert top_level(imported_modules(module)) <= {
            "__future__", "collections", "difflib", "json", "logging", "socket", "time",
            "pathlib", "typing", "msgspec", "dspark_client", "protocol"}, name


PLUGIN_PROBE = """
import importlib.metadata, json, sys
import dspark_vllm
print(json.dumps({"modules": sorted(sys.modules), "register": callable(dspark_vllm.register)}))
"""


def test_loading_the_vllm_plugin_imports_neither_vllm_nor_torch() -> None:
    """What vLLM's loader imports in every process is the entry point's module alone: the
    method is registered by qualified name, so vLLM resolves the config when it needs it."""
    out = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["register"]
    loaded = {m.split(".")[0] for m in result["modules"]}
    assert not loaded & {"torch", "vllm", "dspark_worker", "dspark_client", "numpy"}


PROBE = """
import json, sys
import protocol, protocol.wire, protocol.sampled, protocol.validate, protocol.identity
import protocol.auth
print(json.dumps(sorted(sys.modules)))
"""


# The model-family seam (docs/architecture.md, "Model families"): only the family registry
# imports a family's module; the rings, the walk, sampling, the drafter handle, the runner and
# the rest of the worker see DraftModel and DrafterConfig alone.
FAMILY_MODULES = {"dspark_worker.drafter.gemma4"}
FAMILY_NAMES = {"DrafterModel", "Gemma4DrafterModel", "Gemma4Config", "expected_shapes",
                "parse_qwen3_config"}
FAMILY_BLIND = ["dspark_worker/drafter/rings.py", "dspark_worker/drafter/walk.py",
                "dspark_worker/drafter/sampling.py", "dspark_worker/drafter/drafter.py",
                "dspark_worker/runner.py", "dspark_worker/dispatch.py",
                "dspark_worker/server.py", "dspark_worker/sessions.py", "dspark_worker/app.py"]


@pytest.mark.parametrize("path", FAMILY_BLIND)
def test_only_the_registry_knows_the_families(path: str) -> None:
    modules = imported_modules(ROOT / path)
    assert not modules & FAMILY_MODULES, f"{path} imports a model family directly"
    names = {m.rsplit(".", 1)[-1] for m in modules if m.startswith("dspark_worker.drafter.")}
    assert not names & FAMILY_NAMES, f"{path} imports {sorted(names & FAMILY_NAMES)}"


def test_importing_protocol_loads_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    loaded = set(json.loads(out.stdout))
    assert {"protocol.wire", "protocol.sampled", "protocol.validate", "protocol.identity",
            "protocol.auth", "numpy", "msgspec"} <= loaded
    heavy = sorted(m for m in loaded if m.split(".")[0] in (
        "torch", "dspark_worker", "dspark_client", "safetensors", "asyncio", "uvloop",
        "prometheus_client"))
    assert heavy == []


CLIENT_PROBE = """
import importlib.abc, json, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "uvloop", "prometheus_client"):
            raise ImportError(f"{name} is blocked in this probe")
        return None

sys.meta_path.insert(0, Block())
import dspark_client, dspark_client.metrics
stats = dspark_client.Stats()
stats.inc("rounds_ok")
assert dspark_client.client_metrics(stats)["dspark_client_rounds_drafted_total"] == 1
try:
    dspark_client.prometheus_collector(stats)
except ImportError as exc:
    print(json.dumps({"collector": str(exc), "modules": sorted(sys.modules)}))
"""


def test_dspark_client_imports_without_torch_uvloop_or_prometheus_client() -> None:
    """The engine side needs none of them; its collector imports prometheus_client lazily, so
    only an engine that asks for one needs it."""
    out = subprocess.run([sys.executable, "-c", CLIENT_PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert "prometheus_client is blocked" in result["collector"]
    loaded = {m.split(".")[0] for m in result["modules"]}
    assert "dspark_client" in loaded
    assert not loaded & {"torch", "uvloop", "prometheus_client", "dspark_worker"}
