"""Imports run one way (chunkstore/__init__.py): a test that reads every module's imports,
function-level ones included, and fails on any that breaks the rules below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"chunkstore": ROOT / "chunkstore", "chunkstore_vllm": ROOT / "connector"}

# Module prefix -> the project modules it may import (itself, and always the package root
# for __version__); None: a face (FORBIDDEN says what it must not import). The first matching
# prefix wins.
ALLOWED: list[tuple[str, tuple[str, ...] | None]] = [
    ("chunkstore.errors", ()),
    ("chunkstore.kv", ("chunkstore.kv", "chunkstore.errors")),
    # The policy over the chunk math: what each chunk of a request gets.
    ("chunkstore.policy", ("chunkstore.policy", "chunkstore.kv", "chunkstore.errors")),
    ("chunkstore.protocol", ("chunkstore.protocol", "chunkstore.kv", "chunkstore.errors")),
    # Device memory: runtimes, IPC pools and their kernels, over the shared layout and digest.
    (
        "chunkstore.device",
        ("chunkstore.device", "chunkstore.protocol", "chunkstore.kv", "chunkstore.errors"),
    ),
    (
        "chunkstore.daemon",
        (
            "chunkstore.daemon",
            "chunkstore.device",
            "chunkstore.protocol",
            "chunkstore.kv",
            "chunkstore.errors",
        ),
    ),
    # Under the client: its calls, its session, the transports its bytes move over.
    (
        "chunkstore.transport",
        (
            "chunkstore.transport",
            "chunkstore.device",
            "chunkstore.protocol",
            "chunkstore.kv",
            "chunkstore.errors",
        ),
    ),
    (
        "chunkstore.client",
        ("chunkstore.transport", "chunkstore.protocol", "chunkstore.kv", "chunkstore.errors"),
    ),
    ("chunkstore.prompts", ("chunkstore.kv", "chunkstore.errors")),
    # The connector's settings, which the router and the benches read too: the daemon's
    # default address, the chunk math and the policy.
    (
        "chunkstore.connector_config",
        ("chunkstore.client", "chunkstore.policy", "chunkstore.kv", "chunkstore.errors"),
    ),
    # The HF reference: the chunk math and the policy (chunkstore.policy.treatment), never the
    # connector whose output it judges.
    ("chunkstore.reference", ("chunkstore.policy", "chunkstore.kv", "chunkstore.errors")),
    # The front door: keys as the connector makes them, the daemons asked, never the
    # connector itself (it runs where vLLM does not).
    (
        "chunkstore.router",
        (
            "chunkstore.router",
            "chunkstore.prompts",
            "chunkstore.client",
            "chunkstore.protocol",
            "chunkstore.policy",
            "chunkstore.kv",
            "chunkstore.errors",
        ),
    ),
    # What user commands run beside the daemon: product code, so never the test helpers.
    ("chunkstore.models", ()),
    (
        "chunkstore.processes",
        (
            "chunkstore.processes",
            "chunkstore.client",
            "chunkstore.protocol",
            "chunkstore.kv",
            "chunkstore.errors",
        ),
    ),
    # The connector's commands (``chunkstore doctor``, ``bench hook``, found through entry
    # points): faces, which run the benches, the reference and vLLM beside the connector.
    ("chunkstore_vllm.doctor", None),
    ("chunkstore_vllm.hook.bench", None),
    (
        "chunkstore_vllm",
        (
            "chunkstore_vllm",
            "chunkstore.client",
            "chunkstore.connector_config",
            "chunkstore.policy",
            "chunkstore.kv",
            "chunkstore.errors",
            "chunkstore.ingest",
            "chunkstore.prompts",
        ),
    ),
]


# Faces, free otherwise, and what they must not import: the test helpers are not product code.
# chunkstore never imports the connector (it depends on chunkstore): its commands come in
# through entry points (pyproject.toml).
FORBIDDEN: list[tuple[str, tuple[str, ...]]] = [
    ("chunkstore", ("chunkstore_vllm",)),
    ("chunkstore.cli", ("chunkstore.testing",)),
    ("chunkstore.bench", ("chunkstore.testing",)),
    ("chunkstore_vllm.doctor", ("chunkstore.testing",)),
    ("chunkstore_vllm.hook.bench", ("chunkstore.testing",)),
]


def module_name(path: Path) -> str:
    for package, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def project_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for folder in PACKAGES.values()
        for path in folder.rglob("*.py")
        if "chunkstore_pb2" not in path.name  # generated
    }


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules ``module`` imports, anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")
                parent = parent if is_package else parent[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def broken_rules(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """``sources``: module -> (source, is_package). One line per forbidden import."""
    known = set(sources)
    problems = []
    for module, (source, is_package) in sorted(sources.items()):
        rule = next((allowed for prefix, allowed in ALLOWED if _under(module, prefix)), None)
        banned = [b for prefix, names in FORBIDDEN if _under(module, prefix) for b in names]
        for name in sorted(imports_of(source, module, is_package, known)):
            if rule is not None:  # a layer: only what its rule names
                allowed = name == "chunkstore" or any(_under(name, ok) for ok in (module, *rule))
            else:  # a face (cli, ingest, bench, testing): anything but what it is banned
                allowed = not any(_under(name, b) for b in banned)
            if not allowed:
                problems.append(f"{module} imports {name}")
    return problems


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def project_sources() -> dict[str, tuple[str, bool]]:
    """Every project module -> (its source, whether it is a package's ``__init__``)."""
    return {
        name: (path.read_text(), path.name == "__init__.py")
        for name, path in project_modules().items()
    }


def test_imports_run_one_way() -> None:
    sources = project_sources()
    assert len(sources) > 40
    assert broken_rules(sources) == []


def test_chunkstore_imports_nothing_of_the_connector() -> None:
    """The package loop stays cut (issue 95): no module under chunkstore/ imports
    ``chunkstore_vllm``, at the top or inside a function; what drives the connector lives in
    it and is found through entry points."""
    sources = project_sources()
    known = set(sources)
    found = [
        f"{module} imports {name}"
        for module, (source, is_package) in sorted(sources.items())
        if _under(module, "chunkstore")
        for name in sorted(imports_of(source, module, is_package, known))
        if _under(name, "chunkstore_vllm")
    ]
    assert len([m for m in sources if _under(m, "chunkstore")]) > 40
    assert found == []


def test_the_rule_check_catches_what_it_is_for() -> None:
    """The checker itself: each kind of forbidden import is reported, allowed ones are not."""
    sources = {
        "chunkstore.kv.rope": ("import torch\nfrom chunkstore.errors import LayoutError", False),
        "chunkstore.kv.masks": ("from chunkstore.daemon import index", False),
        "chunkstore.daemon": ("", True),
        "chunkstore.daemon.index": ("", False),
        "chunkstore.daemon.directory": ("def f():\n    from chunkstore.client import X", False),
        "chunkstore.client": ("from chunkstore.daemon.pool import gather", False),
        "chunkstore_vllm": ("", True),
        "chunkstore_vllm.worker": ("from .common import A\nimport chunkstore.protocol", False),
        "chunkstore_vllm.common": ("", False),
        "chunkstore.protocol": ("", True),
        "chunkstore.testing": ("", True),
        "chunkstore.testing.entries": ("", False),
        "chunkstore.bench.e2e": ("def f():\n    from chunkstore.testing import entries", False),
        "chunkstore.cli": ("from chunkstore.daemon import index", False),
        "chunkstore.processes.daemon": ("from chunkstore.testing.entries import wait_for", False),
        "chunkstore.models": ("import chunkstore.bench.e2e", False),
        "chunkstore.bench.quality": ("def f():\n    from chunkstore_vllm import config", False),
        "chunkstore_vllm.config": ("", False),
        "chunkstore_vllm.doctor.stages": ("from chunkstore.bench import quality", False),
    }
    assert broken_rules(sources) == [
        "chunkstore.bench.e2e imports chunkstore.testing.entries",
        "chunkstore.bench.quality imports chunkstore_vllm.config",
        "chunkstore.client imports chunkstore.daemon.pool",
        "chunkstore.daemon.directory imports chunkstore.client",
        "chunkstore.kv.masks imports chunkstore.daemon.index",
        "chunkstore.models imports chunkstore.bench.e2e",
        "chunkstore.processes.daemon imports chunkstore.testing.entries",
        "chunkstore_vllm.worker imports chunkstore.protocol",
    ]


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (function-level imports too: a lazy import is
    a dependency all the same), less imports of its own ancestor packages. Python runs a
    package's ``__init__`` before any module in it, so a module importing its package (the
    root ``chunkstore`` for ``__version__``, or ``from chunkstore.protocol import
    chunkstore_pb2``) reads a namespace that is there already and orders nothing; the other
    direction, an ``__init__`` importing its submodules to expose them, is an edge like any."""
    known = set(sources)
    return {
        module: {
            name
            for name in imports_of(source, module, is_package, known)
            if name in known and name != module and not _under(module, name)
        }
        for module, (source, is_package) in sources.items()
    }


def circles(graph: dict[str, set[str]]) -> list[str]:
    """One line per group of modules that import each other round (a strongly connected
    component of more than one module), naming one circle through it: "a -> b -> a"."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        order[module] = low[module] = len(order)
        stack.append(module)
        for name in sorted(graph[module]):
            if name not in order:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], order[name])
        if low[module] == order[module]:  # the root of a group: it is on the stack above it
            group = set(stack[stack.index(module) :])
            del stack[stack.index(module) :]
            if len(group) > 1:
                found.append(" -> ".join(_circle_through(min(group), group, graph)))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(found)


def _circle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for name in sorted(graph[module] & group):
                if name == start:
                    return [*paths[module], start]
                if name not in paths:
                    paths[name] = [*paths[module], name]
                    following.append(name)
        frontier = following
    raise AssertionError(f"{start} is on no circle in {group}")


def test_no_import_circles_between_files() -> None:
    """Each file imports downward only: no two modules import each other, however round."""
    assert circles(import_graph(project_sources())) == []


def test_the_circle_check_catches_what_it_is_for() -> None:
    """The checker itself: a circle through a lazy import is reported with its path, each
    group once; a package importing its submodules, and a module importing the package root,
    are not circles."""
    sources = {
        "chunkstore": ("from chunkstore import kv", True),
        "chunkstore.kv": ("from chunkstore.kv import rope", True),
        "chunkstore.kv.rope": ("import chunkstore\ndef f():\n    from . import rope_npu", False),
        "chunkstore.kv.rope_npu": ("from chunkstore.kv.rope import RotaryConfig", False),
        "chunkstore.protocol": ("", True),
        "chunkstore.protocol.a": ("from chunkstore.protocol import b", False),
        "chunkstore.protocol.b": ("from chunkstore.protocol.c import X", False),
        "chunkstore.protocol.c": ("from .a import Y\nfrom chunkstore.kv import rope", False),
    }
    assert circles(import_graph(sources)) == [
        "chunkstore.kv.rope -> chunkstore.kv.rope_npu -> chunkstore.kv.rope",
        "chunkstore.protocol.a -> chunkstore.protocol.b -> chunkstore.protocol.c"
        " -> chunkstore.protocol.a",
    ]


def test_every_package_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages a wheel (an image's ``pip install``) carries: a
    folder left out installs in editable mode and is missing everywhere else."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        module_name(init.parent / "__init__.py")
        for folder in PACKAGES.values()
        for init in folder.rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found == listed, (sorted(found - listed), sorted(listed - found))


# Parts a facade hands work to, and the modules above them they must never import back: the
# index's parts hold state under its lock and know nothing of it, the service or the process;
# the worker's loads and saves are handed their cache and never reach for the facade.
BELOW: dict[str, tuple[str, ...]] = {
    "chunkstore.daemon.records": ("chunkstore.daemon",),
    "chunkstore.daemon.sessions": ("chunkstore.daemon.index", "chunkstore.daemon.service"),
    "chunkstore.daemon.budgets": ("chunkstore.daemon.index", "chunkstore.daemon.sessions"),
    "chunkstore.daemon.spill": ("chunkstore.daemon.index", "chunkstore.daemon.budgets"),
    "chunkstore.daemon.counts": ("chunkstore.daemon.index", "chunkstore.daemon.service"),
    "chunkstore_vllm.loads": ("chunkstore_vllm.worker", "chunkstore_vllm.saves"),
    "chunkstore_vllm.saves": ("chunkstore_vllm.worker", "chunkstore_vllm.loads"),
    "chunkstore_vllm.registered_cache": ("chunkstore_vllm.worker", "chunkstore_vllm.loads"),
}


def test_parts_stay_below_what_they_serve() -> None:
    sources = project_sources()
    known = set(sources)
    wrong = []
    for part, above in BELOW.items():
        assert part in sources, f"{part} is gone: update BELOW"
        source, is_package = sources[part]
        for name in imports_of(source, part, is_package, known):
            # records may import what sits below the daemon, nothing of the daemon itself
            if any(_under(name, a) for a in above) and not _under(name, part):
                wrong.append(f"{part} imports {name}")
    assert wrong == []
