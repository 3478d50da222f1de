"""The package's layers: no module imports a layer above its own, and the README's layer table names exactly the
modules of each layer, top to bottom.

Imports are read from the source (``ast``, every ``import`` statement, also inside functions), so the check needs
neither a GPU nor the optional integrations installed.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "moe_ep_plugin")

# Top to bottom; a module may import its own layer and the layers below it. Keys are path prefixes inside the
# package; the longest matching prefix decides a module's layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("build", ("_build.py",)),
    ("recipes", ("recipes/",)),
    ("integrations", ("megatron/", "deepspeed/", "deep_ep/")),
    ("MoE glue", ("autograd.py", "buffer_cache.py", "plugin_options.py", "experts.py")),
    ("buffer", ("buffer.py", "low_latency.py", "__init__.py")),
    ("transports", ("transports/", "transports/local.py")),
    ("ops", ("ops/",)),
    ("leaf", ("config.py", "handle.py", "event.py", "gating.py", "launch.py", "traffic.py")),
]
LAYER_NAMES = [name for name, _ in LAYERS]


def _modules() -> dict[str, str]:
    """Dotted module name → path relative to the package, for every ``.py`` file of the package."""
    found = {}
    for directory, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(directory, name), PKG).replace(os.sep, "/")
                parts = ["moe_ep_plugin"] + rel[:-3].split("/")
                if parts[-1] == "__init__":
                    parts.pop()
                found[".".join(parts)] = rel
    return found


MODULES = _modules()


def layer_of(rel: str) -> int:
    """Index in ``LAYERS`` of the module at package-relative path ``rel``."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (rel == prefix or (prefix.endswith("/") and rel.startswith(prefix))) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    assert best is not None, f"moe_ep_plugin/{rel} is in no layer: add it to LAYERS and the README's table"
    return best


def imported_modules(module: str, rel: str) -> set[str]:
    """The package modules ``module`` imports (``from .. import name`` counts as the submodule when one exists)."""
    tree = ast.parse(open(os.path.join(PKG, rel)).read(), rel)
    package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("moe_ep_plugin"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("moe_ep_plugin"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in MODULES else target)
    return {name for name in out if name in MODULES}


def test_every_module_has_a_layer() -> None:
    for rel in MODULES.values():
        layer_of(rel)


def test_no_module_imports_a_layer_above_it() -> None:
    wrong = []
    for module, rel in sorted(MODULES.items()):
        own = layer_of(rel)
        for target in sorted(imported_modules(module, rel)):
            above = layer_of(MODULES[target])
            if above < own:
                wrong.append(f"{module} ({LAYER_NAMES[own]}) imports {target} ({LAYER_NAMES[above]})")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import() -> None:
    """The import reader resolves relative imports: the ones this check must catch are not missed."""
    assert "moe_ep_plugin.buffer" in imported_modules("moe_ep_plugin.autograd", "autograd.py")
    assert "moe_ep_plugin.ops.library" in imported_modules("moe_ep_plugin.ops.permute", "ops/permute.py")
    assert "moe_ep_plugin.ops.fp8" in imported_modules("moe_ep_plugin.buffer", "buffer.py")
    assert layer_of("recipes/megatron/pretrain.py") < layer_of("megatron/dispatcher.py") < layer_of("buffer.py")
    assert layer_of("transports/nvlink/plan.py") < layer_of("ops/library.py")


def _readme_table() -> list[tuple[str, list[str]]]:
    """The README's layer table: ``(layer, [backticked paths of its "where" column])`` top to bottom."""
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("| layer | where | what |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def test_readme_layer_table_matches_the_tree() -> None:
    """Same layers in the same order as ``LAYERS`` (plus ``kernels``, ``csrc/``, at the bottom); every path it
    names exists; every package module lies under a path of its own layer's row."""
    rows = _readme_table()
    assert [name for name, _ in rows] == LAYER_NAMES + ["kernels"]
    where = dict(rows)
    assert where["kernels"] == ["csrc/"]
    for name, paths in rows:
        for path in paths:
            full = (
                path
                if path.startswith(("moe_ep_plugin/", "examples/", "configs/", "csrc/"))
                else os.path.join("moe_ep_plugin", path)
            )
            assert os.path.exists(os.path.join(ROOT, full)), f"README layer {name!r} names {path}, which does not exist"
    for rel in MODULES.values():
        name = LAYER_NAMES[layer_of(rel)]
        if rel == "__init__.py":
            continue  # the package's public face: re-exports Buffer, Config, EventOverlap, DispatchHandle
        paths = [p.removeprefix("moe_ep_plugin/") for p in where[name]]
        assert any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in paths), (
            f"moe_ep_plugin/{rel} ({name}) is not under any path of the README's {name!r} row {where[name]}"
        )


@pytest.mark.parametrize("doc", ["docs/kernels.md"])
def test_doc_file_tables_name_existing_files(doc: str) -> None:
    """Every file a docs file table lists (its first column) exists."""
    for line in open(os.path.join(ROOT, doc)):
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            assert os.path.exists(os.path.join(ROOT, match.group(1))), f"{doc} lists {match.group(1)}"


def test_only_ops_and_the_nvlink_runtime_load_the_kernel_library() -> None:
    """Integrations and transports reach the kernels through ``ops``; the nvlink runtime, which owns the library's
    context, is the one module outside ``ops`` that loads it (its constants and structs may be imported anywhere
    below the recipes)."""
    loaders = set()
    for rel in MODULES.values():
        tree = ast.parse(open(os.path.join(PKG, rel)).read(), rel)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("load", "unavailable_reason", "check")
                and isinstance(node.value, ast.Name)
                and node.value.id == "library"
            ):
                loaders.add(rel)
    assert loaders and all(rel.startswith("ops/") or rel == "transports/nvlink/runtime.py" for rel in loaders), loaders
