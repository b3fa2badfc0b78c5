"""The package map holds (ARCHITECTURE.md): who may import whom, and nobody touches the engine's insides."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "torch_engine", "kv_messenger", "serving", "frontend", "orchestrator", "bench", "builders", "backends", "disagg",
    "planner",
)  # fmt: skip
TRITON = ("triton_python_backend_utils", "tritonclient")

# package -> top-level modules it must never import
FORBIDDEN = {
    "torch_engine": (
        "kv_messenger",
        "serving",
        "frontend",
        "orchestrator",
        "bench",
        "backends",
        "disagg",
        "planner",
        *TRITON,
    ),
    "kv_messenger": ("serving", "frontend", "orchestrator", "bench", "backends", "disagg", *TRITON),
    "serving": ("frontend", "orchestrator", "bench", "backends", "disagg", "triton_python_backend_utils"),
    "orchestrator": ("bench", "backends", "disagg", "triton_python_backend_utils"),
    # the router talks to decode groups over Triton gRPC only: no engine, messenger or node runtime in it
    "frontend": ("kv_messenger", "orchestrator", "bench", "backends", "disagg", "triton_python_backend_utils"),
    "builders": ("kv_messenger", "serving", "orchestrator", "bench", "backends", "disagg", *TRITON),
    "bench": ("backends", "disagg", "triton_python_backend_utils"),
    # the planner is shared by decode nodes (the placement rule) and ``disagg plan``: it sits below both
    "planner": ("kv_messenger", "serving", "frontend", "orchestrator", "bench", "backends", "disagg", *TRITON),
}


def _sources(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (at module level or inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_rules(package: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _sources(package)
        for name in sorted(_imports(path) & set(FORBIDDEN[package]))
    ]
    assert not bad, "; ".join(bad)


def test_only_backends_import_triton_backend_utils() -> None:
    users = [
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        for p in _sources(pkg)
        if "triton_python_backend_utils" in _imports(p)
    ]
    assert users == ["backends/disagg_backend/model.py"]


# an engine's private member: ``engine._x``, ``self.engine._x``, ``decode._allocator``, ... on a name that
# holds an LLMEngine in these packages (they call it ``engine``, or name it after its role)
_PRIVATE = re.compile(r"\b(?:engine|prefill|decode|ref|tight|roomy)\._[a-z]\w*")


def test_nothing_outside_the_engine_touches_its_private_state() -> None:
    hits = []
    for pkg in (*PACKAGES, "tests"):
        if pkg == "torch_engine":
            continue
        for path in _sources(pkg):
            if path.name == "test_architecture.py":
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _PRIVATE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_engine_has_no_public_allocator_requests_or_runner() -> None:
    from torch_engine.engine import LLMEngine

    src = (ROOT / "torch_engine" / "engine.py").read_text(encoding="utf-8")
    for name in ("allocator", "requests", "runner", "scheduler", "kv", "progress", "model", "manifest", "tp"):
        assert f"self.{name} " not in src and f"self.{name}=" not in src, name
        assert not hasattr(LLMEngine, name), name


def test_an_engine_has_no_public_state(tiny_engine_dir) -> None:
    """Everything an engine shows is a method or a property of its port: no public instance attribute."""
    from tests.helpers import tiny_engine

    engine = tiny_engine(tiny_engine_dir("llama"))
    assert [k for k in vars(engine) if not k.startswith("_")] == []


def _engine_holder(node: ast.expr) -> bool:
    """``engine``, ``eng``, ``self.engine``, ``rank.engine``: the names that hold an engine outside it."""
    if isinstance(node, ast.Name):
        return node.id in ("engine", "eng")
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
        node.attr == "engine" and node.value.id in ("self", "rank")
    )  # fmt: skip


def test_nothing_outside_the_engine_reads_more_than_its_port() -> None:
    """Every attribute read on an engine outside ``torch_engine/`` is a method or property of
    ``LLMEngine``'s port (connector, follower, client and monitor calls, ``describe``)."""
    from torch_engine.engine import LLMEngine

    public = {n for n in dir(LLMEngine) if not n.startswith("_")}
    hits = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for pkg in (*PACKAGES, "tests")
        if pkg != "torch_engine"
        for path in _sources(pkg)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and _engine_holder(node.value) and node.attr not in public
    ]
    assert not hits, "\n".join(hits)


def test_the_links_and_tp_glue_see_the_engine_through_its_protocols_only() -> None:
    for module in ("kv_links", "decode_path", "tp_group"):
        assert "torch_engine.engine" not in _imports_full(ROOT / "serving" / f"{module}.py"), module


def _imports_full(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_circle_in_the_tree() -> None:
    """No module reaches itself through imports (module-level, in functions, or for type checking)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in _sources(pkg)}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {t for t in map(resolve, targets) if t is not None and t != name}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                circles.append(" -> ".join([*path[path.index(m) :], m]))
            elif m not in state:
                visit(m, [*path, m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not circles, "; ".join(circles)


def test_long_files_say_why_at_their_top() -> None:
    """A module over ~400 lines states, in its docstring, why it is one file (``Long because:``)."""
    long = [
        f"{path.relative_to(ROOT)} ({n} lines)"
        for pkg in PACKAGES
        for path in _sources(pkg)
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 420
        and "Long because:" not in (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")
    ]
    assert not long, "; ".join(long)


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (n.name, (n.end_lineno or n.lineno) - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_no_long_functions_in_the_runtime_and_tools() -> None:
    """Functions stay short enough to read at once (the issue named 61-87-line ones)."""
    long = [
        f"{path.relative_to(ROOT)}:{name} ({n} lines)"
        for pkg in ("serving", "frontend", "orchestrator", "bench", "disagg", "kv_messenger")
        for path in _sources(pkg)
        for name, n in _function_lengths(path)
        if n > 60
    ]
    assert not long, "; ".join(long)


def test_model_repository_uses_the_shared_names() -> None:
    """Every model and tensor name in ``model_repo/`` is declared once, in ``serving.names``."""
    from serving.names import BackendRole, Model, Tensor

    for config in sorted((ROOT / "model_repo").glob("*/config.pbtxt")):
        text = config.read_text(encoding="utf-8")
        assert Model(re.search(r'^name: "([^"]+)"', text, re.M).group(1)) is not None  # type: ignore[union-attr]
        for tensor in re.findall(r'\{\s*name:\s*"([^"]+)"', text):
            assert tensor in {t.value for t in Tensor}, f"{config.parent.name}: {tensor}"
        role = re.search(r'key: "role" value: \{ string_value: "([^"]+)"', text)
        if role is not None:
            assert BackendRole(role.group(1)) is not None


_PORT = re.compile(r'\{\s*name:\s*"([^"]+)"\s+data_type:\s*(\w+)\s+dims:\s*\[([^\]]*)\](\s+optional:\s*true)?')


def _section(text: str, name: str) -> list[tuple[str, str, tuple[int, ...], bool]]:
    body = re.search(rf"^{name} \[(.*?)^\]", text, re.M | re.S)
    assert body is not None, name
    found = _PORT.findall(body.group(1))
    return [(n, kind, tuple(int(d) for d in dims.split(",")), bool(opt)) for n, kind, dims, opt in found]


def test_model_configs_match_the_wire_contract() -> None:
    """Each model's inputs and outputs in ``model_repo/*/config.pbtxt`` are exactly its ``Signature``
    in ``serving.wire`` (names, types, dims, optional), and every model has one."""
    from serving.names import Model
    from serving.wire import SIGNATURES

    seen = set()
    for config in sorted((ROOT / "model_repo").glob("*/config.pbtxt")):
        text = config.read_text(encoding="utf-8")
        model = Model(re.search(r'^name: "([^"]+)"', text, re.M).group(1))  # type: ignore[union-attr]
        sig = SIGNATURES[model]
        seen.add(model)
        for name, ports in (("input", sig.inputs), ("output", sig.outputs)):
            want = [(p.tensor.value, p.type.config, p.dims, p.optional and name == "input") for p in ports]
            assert sorted(_section(text, name)) == sorted(want), f"{model} {name}s"
        batch = re.search(r"^max_batch_size: (\d+)", text, re.M)
        assert batch is not None and int(batch.group(1)) == sig.max_batch_size, model
    assert seen == set(SIGNATURES) == set(Model)


def test_test_modules_share_helpers_not_each_other() -> None:
    """Shared test code lives in helper modules (``tests/helpers.py``, the harnesses), never in a
    test module that another imports (its tests would be collected twice, its fixtures tangled)."""
    bad = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for name in _imports_full(path)
        if re.match(r"tests(\.e2e)?\.test_", name)
    ]
    assert not bad, "; ".join(bad)
