"""Imports run one way (chunkstore/__init__.py): a test that reads every module's imports,
function-level ones included, and fails on any that breaks the rules below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"chunkstore": ROOT / "chunkstore", "chunkstore_vllm": ROOT / "connector"}

# Module prefix -> the project modules it may import (itself, and always the package root
# for __version__). The first matching prefix wins.
ALLOWED: list[tuple[str, tuple[str, ...]]] = [
    ("chunkstore.errors", ()),
    ("chunkstore.kv", ("chunkstore.kv", "chunkstore.errors")),
    ("chunkstore.protocol", ("chunkstore.protocol", "chunkstore.kv", "chunkstore.errors")),
    (
        "chunkstore.daemon",
        ("chunkstore.daemon", "chunkstore.protocol", "chunkstore.kv", "chunkstore.errors"),
    ),
    ("chunkstore.client", ("chunkstore.protocol", "chunkstore.kv", "chunkstore.errors")),
    ("chunkstore.prompts", ("chunkstore.kv", "chunkstore.errors")),
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
    (
        "chunkstore_vllm",
        (
            "chunkstore_vllm",
            "chunkstore.client",
            "chunkstore.kv",
            "chunkstore.errors",
            "chunkstore.ingest",
            "chunkstore.prompts",
        ),
    ),
]


# Faces, free otherwise, and what they must not import: the test helpers are not product code.
FORBIDDEN: list[tuple[str, tuple[str, ...]]] = [
    ("chunkstore.cli", ("chunkstore.testing",)),
    ("chunkstore.bench", ("chunkstore.testing",)),
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


def test_imports_run_one_way() -> None:
    sources = {
        name: (path.read_text(), path.name == "__init__.py")
        for name, path in project_modules().items()
    }
    assert len(sources) > 40
    assert broken_rules(sources) == []


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
    }
    assert broken_rules(sources) == [
        "chunkstore.bench.e2e imports chunkstore.testing.entries",
        "chunkstore.client imports chunkstore.daemon.pool",
        "chunkstore.daemon.directory imports chunkstore.client",
        "chunkstore.kv.masks imports chunkstore.daemon.index",
        "chunkstore.models imports chunkstore.bench.e2e",
        "chunkstore.processes.daemon imports chunkstore.testing.entries",
        "chunkstore_vllm.worker imports chunkstore.protocol",
    ]
