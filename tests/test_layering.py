"""The package is layered: a module imports only from its own layer or a lower one.

Data flows api -> policy -> engine -> replay/offload (DESIGN §2), so nothing reaches
back up and there is no import circle. Every import counts, deferred ones inside
functions and ``TYPE_CHECKING`` blocks included: a deferred import is still a circle.
A new module must be given a layer here, which is the moment to ask where it belongs.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "remat"

#: Lowest first. A module's layer is that of the longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    ("remat._errors", "remat._state", "remat._pytree", "remat._compile", "remat._compat",
     "remat._declared_layers"),
    ("remat._policy", "remat.policies"),
    ("remat._replay", "remat._offload"),
    ("remat._capture",),
    ("remat._engines",),
    ("remat._api", "remat._options"),
    ("remat._modules", "remat._apply", "remat._sequential", "remat._inspect"),
    ("remat._demo_model", "remat.testing", "remat.compat", "remat.integrations"),
    ("remat", "remat.__main__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and prefix.count(".") > depth:
                best, depth = level, prefix.count(".")
    if best < 0:
        raise AssertionError(f"{module} has no layer: add it to LAYERS in {__file__}")
    return best


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The remat modules ``module`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule ``pkg.sub``, not pkg's names
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
    return {name for name in found if name in known and name != module}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer_of(name)


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_upward_import(module: str) -> None:
    graph = import_graph()
    upward = sorted(t for t in graph[module] if layer_of(t) > layer_of(module))
    assert not upward, f"{module} (layer {layer_of(module)}) imports from above: {upward}"


def circles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return circles


def test_no_import_circle() -> None:
    circles = circles_in(import_graph())
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_checker_sees_a_circle() -> None:
    graph = {"a.base": {"a.lib"}, "a.lib": {"a.strings"}, "a.strings": {"a.base"}, "b": set()}
    assert circles_in(graph) == [["a.base", "a.lib", "a.strings", "a.base"]]


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The rule can fail: a deferred upward import inside a function is found."""
    fake = tmp_path / "remat" / "_replay" / "records.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from .._engines import eager\n")
    found = imports_of("remat._replay.records", fake, {"remat._engines.eager", "remat._engines"})
    assert found == {"remat._engines.eager"}
    assert layer_of("remat._engines.eager") > layer_of("remat._replay.records")


# -- private torch lives in remat/_compat.py (NOTE [ Private torch ]) ---------

#: Private torch names allowed outside ``remat/_compat.py``, each with its reason.
PRIVATE_TORCH_EXCEPTIONS: dict[str, str] = {}


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_torch_names(source: str) -> set[tuple[int, str]]:
    """(line, dotted name) of each private torch module or attribute ``source`` names."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # a local name -> the torch module or object it binds
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                if any(_is_private(p) for p in alias.name.split(".")):
                    found.add((node.lineno, alias.name))
                aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            parts = node.module.split(".")
            if parts[0] != "torch":
                continue
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if any(_is_private(p) for p in [*parts, alias.name]):
                    found.add((node.lineno, name))
                aliases[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        chain: list[str] = []
        current: ast.AST = node
        while isinstance(current, ast.Attribute):
            chain.insert(0, current.attr)
            current = current.value
        if chain and isinstance(current, ast.Name) and current.id in aliases:
            private = [i for i, part in enumerate(chain) if _is_private(part)]
            if private:  # named up to its first private part
                dotted = ".".join([aliases[current.id], *chain[: private[0] + 1]])
                found.add((node.lineno, dotted))
    return found


def test_private_torch_only_in_compat() -> None:
    outside = {
        f"{name}:{line} {dotted}"
        for name, path in modules().items()
        if name != "remat._compat"
        for line, dotted in private_torch_names(path.read_text())
        if dotted not in PRIVATE_TORCH_EXCEPTIONS
    }
    assert not outside, (
        "private torch outside remat/_compat.py (give it a named function there): "
        + ", ".join(sorted(outside))
    )


def test_the_checker_sees_private_torch() -> None:
    source = (
        "import torch\n"
        "import torch.utils.checkpoint as ckpt\n"
        "from torch import nn\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "a = torch._C._functorch.get_unwrapped\n"
        "b = ckpt._CachingTorchDispatchMode\n"
        "c = nn.modules.module._global_forward_pre_hooks\n"
        "d = torch.compiler.is_compiling, torch.__version__, x._version\n"
    )
    assert {name for _, name in private_torch_names(source)} == {
        "torch.utils._python_dispatch.TorchDispatchMode",
        "torch._C",
        "torch.utils.checkpoint._CachingTorchDispatchMode",
        "torch.nn.modules.module._global_forward_pre_hooks",
    }


# -- each per-thread field has one owner (NOTE [ Thread state ] rule 2) ---------

_STATE_MODULE = "remat._state"
_MUTATORS = frozenset({"append", "pop", "remove", "clear", "extend", "insert"})


def field_owners() -> dict[str, str]:
    """Each `ThreadState` field -> the module or package prefix its comment names owner."""
    lines = (PACKAGE / "_state.py").read_text().splitlines()
    owners: dict[str, str] = {}
    owner: str | None = None
    for line in lines:
        found = line.partition("Owner: ")[2]
        if found:
            path = found.split("``")[1] if found.startswith("``") else None
            owner = _STATE_MODULE if path is None else "remat." + path.removesuffix(
                ".py").strip("/").replace("/", ".")
        field = line.strip().partition(" = ")[0].partition(":")[0]
        if field.startswith("self.") and owner is not None:
            owners[field.removeprefix("self.")] = owner
            owner = None
    return owners


def field_writes(source: str, fields: set[str]) -> set[tuple[int, str]]:
    """(line, field) of each direct write of ``local.<field>`` (or ``state.<field>``)."""

    def is_field(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr in fields
            and isinstance(node.value, ast.Name)
            and node.value.id in ("local", "state")
        )

    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if is_field(part):
                    assert isinstance(part, ast.Attribute)
                    found.add((node.lineno, part.attr))
    return found


def test_every_thread_state_field_names_its_owner() -> None:
    from remat._state import ThreadState

    assert set(field_owners()) == set(vars(ThreadState()))
    for field, owner in field_owners().items():
        assert owner in modules() or any(m.startswith(owner + ".") for m in modules()), (
            f"ThreadState.{field}: its owner {owner} is no module of remat"
        )


def test_only_its_owner_writes_a_thread_state_field() -> None:
    owners = field_owners()
    strangers = {
        f"{name}:{line} writes {field} (owner: {owners[field]})"
        for name, path in modules().items()
        for line, field in field_writes(path.read_text(), set(owners))
        if not (name == owners[field] or name.startswith(owners[field] + "."))
    }
    assert not strangers, "call the owner's function instead: " + ", ".join(sorted(strangers))


def test_the_checker_sees_a_stranger_write_a_field() -> None:
    source = (
        "local.internal_depth += 1\n"
        "local.inspecting, local.frames = None, []\n"
        "state.traces.append(None)\n"
        "other.internal_depth = 0\n"
    )
    assert field_writes(source, {"internal_depth", "inspecting", "frames", "traces"}) == {
        (1, "internal_depth"), (2, "inspecting"), (2, "frames"), (3, "traces"),
    }
