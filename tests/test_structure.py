"""The package's shape, read from the source (``ast``): no function over 60 lines, no class over 400, no file over
500, counted in logical lines (statements, however many physical lines the formatter breaks them into; each
exception listed with its reason); a group of one rank handled in one place (``transports/local.py``,
which the registry picks for it); ``ctypes`` only behind the kernel library's face; comments and docstrings of the
package and ``csrc/`` name only paths that exist (or build outputs).
"""

from __future__ import annotations

import ast
import bisect
import io
import os
import re
import tokenize

from moe_ep_plugin.ops.library import LIB_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "moe_ep_plugin")

MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_FILE_LINES = 60, 400, 500

# (path suffix inside the package, qualified name) → why it is longer. A suffix, so that a module moving to another
# folder keeps its entry; a function's lines include the closures it returns.
LONG = {
    (
        "transports/hierarchical.py",
        "HierarchicalTransport.dispatch",
    ): "the two stages' chunk pipeline and the closure that finishes it share the in-flight chunks",
    (
        "transports/torch_transport.py",
        "TorchTransport.start_dispatch",
    ): "the all-to-alls are issued before the closure that unpacks them; both read the same metadata columns",
    (
        "transports/torch_transport.py",
        "TorchTransport._start_layout",
    ): "the count exchange in flight while the send order is built, and the closure that reads it",
    (
        "transports/low_latency_torch.py",
        "TorchLowLatency.dispatch",
    ): "DeepEP's fixed slot layout is built before the exchange and unpacked by the closure after it",
    (
        "buffer.py",
        "Buffer._dispatch_args",
    ): "every DeepEP dispatch argument validated in one place, before any communication",
    ("buffer.py", "Buffer"): "DeepEP's Buffer API (normal and low-latency calls, streams, events) on one class",
    ("buffer.py", None): "DeepEP's Buffer API and its argument checks",
    ("megatron/pretrain.py", "_run"): "a recipe's main loop (the launcher's steps in order)",
    ("train/config.py", "validate"): "a recipe's cross-field checks of its YAML",
    ("megatron/yaml_config.py", "build_transformer_config"): "one YAML key after another onto TransformerConfig",
}

# Modules that may branch on a group of one rank: the transport for it, the registry that picks it, and the recipes
# whose one-rank data-parallel group has no gradients to reduce (no transport path).
ONE_RANK_BRANCHES = ("transports/local.py", "transports/__init__.py", "megatron/pretrain.py", "train/trainer.py")
RANK_COUNTS = {"num_ranks", "world_size", "group_size", "world", "get_world_size"}

CTYPES_HOMES = ("ops/library.py", "transports/nvlink/runtime.py")

# What ``_build.py`` writes (the kernel library and its stamp): a comment may name it whether or not it was built,
# as after ``MOE_EP_SKIP_KERNELS=1 pip install -e .`` or on a machine without nvcc.
BUILD_OUTPUTS = (f"moe_ep_plugin/{os.path.basename(os.path.dirname(LIB_PATH))}/",)


def _sources() -> dict[str, str]:
    """Package-relative path → source of every ``.py`` file of the package."""
    found = {}
    for directory, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                found[os.path.relpath(path, PKG).replace(os.sep, "/")] = open(path).read()
    return found


SOURCES = _sources()


def _exception(rel: str, name: str | None) -> str | None:
    return next((why for (suffix, qual), why in LONG.items() if rel.endswith(suffix) and qual == name), None)


def _definitions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function and class, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + node.name
            yield name, node
            yield from _definitions(node, name + ".")
        else:
            yield from _definitions(node, prefix)


def _logical_line_ends(source: str) -> list[int]:
    """Sorted physical line numbers where a logical line ends: what the size caps count, so that where a formatter
    breaks a long statement changes no count (a docstring is one line, comments none)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [tok.end[0] for tok in tokens if tok.type == tokenize.NEWLINE]


def test_no_long_function_class_or_file() -> None:
    too_long = []
    for rel, source in SOURCES.items():
        ends = _logical_line_ends(source)
        lines = len(ends)
        if lines > MAX_FILE_LINES and _exception(rel, None) is None:
            too_long.append(f"moe_ep_plugin/{rel}: {lines} lines > {MAX_FILE_LINES}")
        for name, node in _definitions(ast.parse(source, rel)):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            length = bisect.bisect_right(ends, node.end_lineno) - bisect.bisect_left(ends, node.lineno)
            if length > limit and _exception(rel, name) is None:
                too_long.append(f"moe_ep_plugin/{rel}: {name} has {length} lines > {limit}")
    assert not too_long, "split these, or list each in LONG with its reason:\n" + "\n".join(too_long)


def _rank_count(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        node = node.func
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
    return name in RANK_COUNTS


def _one_rank_test(node: ast.Compare) -> bool:
    """``count == 1``, ``!= 1``, ``> 1``, ``<= 1``, ``< 2``, ``>= 2`` (either side) on a rank count."""
    if len(node.ops) != 1:
        return False
    left, op, right = node.left, node.ops[0], node.comparators[0]
    for count, other, flipped in ((left, right, False), (right, left, True)):
        if not (_rank_count(count) and isinstance(other, ast.Constant) and isinstance(other.value, int)):
            continue
        kind = type(op)
        if flipped:
            kind = {ast.Gt: ast.Lt, ast.Lt: ast.Gt, ast.GtE: ast.LtE, ast.LtE: ast.GtE}.get(kind, kind)
        if other.value == 1 and kind in (ast.Eq, ast.NotEq, ast.Gt, ast.LtE):
            return True
        if other.value == 2 and kind in (ast.Lt, ast.GtE):
            return True
    return False


def test_one_rank_is_handled_by_the_local_transport_only() -> None:
    found = []
    for rel, source in SOURCES.items():
        if rel.endswith(ONE_RANK_BRANCHES):
            continue
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, ast.Compare) and _one_rank_test(node):
                found.append(f"moe_ep_plugin/{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a one-rank branch outside transports/local.py:\n" + "\n".join(found)


def test_the_check_sees_a_one_rank_branch() -> None:
    for code in (
        "self.num_ranks == 1",
        "1 == num_ranks",
        "dist.get_world_size(g) > 1",
        "world < 2",
        "self.group_size != 1",
    ):
        assert _one_rank_test(ast.parse(code, mode="eval").body), code
    for code in ("len(parts) == 1", "topk == 1", "self.num_ranks == 4"):
        assert not _one_rank_test(ast.parse(code, mode="eval").body), code


def test_ctypes_only_behind_the_library_face() -> None:
    users = set()
    for rel, source in SOURCES.items():
        for node in ast.walk(ast.parse(source, rel)):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(name.split(".")[0] == "ctypes" for name in names):
                users.add(rel)
    assert users <= set(CTYPES_HOMES), sorted(users - set(CTYPES_HOMES))


# A repository path in a comment or docstring: one of these folders, then a file or folder name.
_PATH = re.compile(r"(?<![\w/.])((?:moe_ep_plugin|csrc|docs|tests|benchmarks|configs|examples|scripts)/[\w./-]*\w)")


def _cited_paths(text: str) -> set[str]:
    """The paths ``text`` names, without the patterns (a name followed by ``*``)."""
    return {m.group(1) for m in _PATH.finditer(text) if not text.startswith("*", m.end())}


def test_comments_name_existing_paths() -> None:
    """Paths the package's and ``csrc/``'s comments and docstrings cite exist (a glob-like ``*`` is not a path; a
    build output need not)."""
    missing = []
    texts = {f"moe_ep_plugin/{rel}": source for rel, source in SOURCES.items()}
    for directory, _, files in os.walk(os.path.join(ROOT, "csrc")):
        for name in files:
            path = os.path.join(directory, name)
            texts[os.path.relpath(path, ROOT)] = open(path).read()
    for where, text in texts.items():
        for path in _cited_paths(text):
            if path.startswith(BUILD_OUTPUTS):
                continue
            full = os.path.join(ROOT, path)
            if not os.path.exists(full) and not os.path.exists(os.path.join(PKG, path)):
                missing.append(f"{where} names {path}")
    assert not missing, "\n".join(sorted(missing))
