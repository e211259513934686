"""The import graph of dflash_jax: no cycles (function-level imports counted), no private name taken from another
module, and no layer importing a layer above it.

Layers, bottom → top (docs/engine.md; a module may import its own layer and those below):
tuning, config, tokenizer → kernels (attention, pallas, cuda) → quant (quantized weights: schemes, host-side
arithmetic) → sharding → models → families → checkpoints,
loading, costs, pairs, draft_vocab → drafters → decode → settings → engine → generation, streaming, batch,
chat, cli, train, the package's own ``__init__``. ``costs`` (the table type and its files) imports nothing of the
library; it sits with ``loading``, which attaches a pair's tables to its drafter.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dflash_jax"

LAYERS = [
    ("tuning", "config", "tokenizer"),
    ("kernels", "pallas", "cuda"),
    ("quant",),
    ("sharding",),
    ("models",),
    ("families",),
    ("checkpoints", "loading", "costs", "pairs", "draft_vocab"),
    ("drafters",),
    ("decode",),
    ("settings",),
    ("engine",),
    ("generation", "streaming", "batch", "chat", "cli", "train", "__init__"),
]

# Nothing is allowed: the sets below stay empty (a test keeps them so), and a new offender fails.
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()  # (importer, module, name)
KNOWN_UPWARD: set[tuple[str, str]] = set()  # (importer, imported)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom) -> str | None:
    if node.level:
        base = importer.split(".")
        base = base if _is_package(importer) else base[:-1]
        base = base[: len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module


@functools.cache
def parsed(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text())


def imports(name: str) -> list[tuple[str, str | None]]:
    """(module imported, name taken from it or None) for every import of ``name``, at any depth."""
    tree = parsed(name)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("dflash_jax")]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, node)
            if not mod or not mod.startswith("dflash_jax"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub, None) if sub in MODULES else (mod, a.name))
    return out


def private_attributes(name: str) -> list[tuple[str, str]]:
    """(module, attribute) for ``alias._private`` reads where ``alias`` is a dflash_jax module imported here."""
    tree = parsed(name)
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dflash_jax"):
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, node)
            for a in node.names:
                if mod and f"{mod}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{mod}.{a.name}"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append((aliases[node.value.id], node.attr))
    return out


@functools.cache
def graph() -> dict[str, set[str]]:
    return {name: {m for m, _ in imports(name) if m in MODULES and m != name} for name in MODULES}


def layer(name: str) -> int:
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    for i, members in enumerate(LAYERS):
        if key in members:
            return i
    raise AssertionError(f"{name}: in no layer of tests/test_architecture.py's LAYERS (add it)")


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_in_a_layer():
    for name in MODULES:
        layer(name)


def test_no_import_cycles():
    found = cycles(graph())
    new = [sorted(c) for c in found if not any(c <= known or known <= c for known in KNOWN_CYCLES)]
    assert not new, f"import cycles (function-level imports counted): {new}"


def test_no_private_names_across_modules():
    found = set()
    for name in MODULES:
        for mod, attr in imports(name):
            if attr and attr.startswith("_") and not attr.startswith("__") and mod != name:
                found.add((name, mod, attr))
        for mod, attr in private_attributes(name):
            if mod != name:
                found.add((name, mod, attr))
    new = sorted(found - KNOWN_PRIVATE)
    assert not new, f"private names imported across modules (importer, module, name): {new}"


def test_no_upward_imports():
    found = {(name, m) for name, ms in graph().items() for m in ms if layer(m) > layer(name)}
    # A package's __init__ may import its own submodules.
    found = {(a, b) for a, b in found if not b.startswith(a + ".")}
    new = sorted(found - KNOWN_UPWARD)
    assert not new, f"lower layers importing higher ones (importer, imported): {new}"


@pytest.mark.parametrize("area", ["engine", "settings", "generation", "streaming", "batch", "chat", "cli", "costs"])
def test_the_host_side_is_clean(area):
    """The host side (settings, costs, engine and its clients) has no allowance at all."""
    mine = lambda name: name == f"dflash_jax.{area}" or name.startswith(f"dflash_jax.{area}.")  # noqa: E731
    assert not [c for c in cycles(graph()) if any(mine(m) for m in c)]
    assert not [k for k in KNOWN_PRIVATE | KNOWN_UPWARD if mine(k[0])]
