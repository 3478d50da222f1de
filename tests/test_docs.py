"""Every repository path and module the user-facing docs name exists: links and backticked paths in README.md,
docs/*.md and benchmarks/RESULTS.md, and backticked ``moe_ep_plugin.*`` module names."""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "benchmarks/RESULTS.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
# Where a relative path may start besides the repository root and the doc's own folder: the README's layer table
# and the kernel docs name package and csrc/ files relative to their folder.
BASES = ["", "moe_ep_plugin", "csrc"]
# Written by a run or a build, not part of a clone.
GENERATED = ("runs/", "moe_ep_plugin/lib/", "lib/", "/tmp/", ".whl/")
PATH_TOKEN = re.compile(r"^(\.{0,2}/)?[\w.\-]+(/[\w.\-]+)*/?$")
FILE_SUFFIX = re.compile(r"\.(py|md|yaml|yml|cu|cuh|h|cc|cpp|sh|toml|png|txt|cfg|json)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
MODULE = re.compile(r"^moe_ep_plugin(\.\w+)+$")


def _strip_fenced(text: str) -> str:
    """The text without ``` blocks: commands there name files they write as often as files they read."""
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def _is_path(token: str) -> bool:
    """A token names a repository path when it has a folder part (``benchmarks/soak.py``, ``recipes/train/``) or is
    a bare Markdown file name; bare names of other files are mostly a command's outputs (``loss.png``)."""
    if not PATH_TOKEN.match(token) or token.startswith(GENERATED) or "NNN" in token:
        return False
    if "/" in token.rstrip("/"):
        return token.endswith("/") or FILE_SUFFIX.search(token) is not None
    return token.endswith(".md")


def _exists(doc: str, path: str) -> bool:
    here = os.path.dirname(os.path.join(ROOT, doc))
    candidates = [os.path.normpath(os.path.join(here, path))]
    candidates += [os.path.normpath(os.path.join(ROOT, base, path)) for base in BASES]
    return any(c.startswith(ROOT + os.sep) and os.path.exists(c) for c in candidates)


def _defines(path: str, name: str) -> bool:
    """Whether the module at ``path`` binds ``name`` at its top level (def, class, assignment or import)."""
    tree = ast.parse(open(path).read(), path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
    return False


def _module_exists(dotted: str) -> bool:
    """``moe_ep_plugin.a.b`` is a module of the package, or a module followed by a name it defines (and, for a
    class, one attribute)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:cut])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.exists(path):
                rest = parts[cut:]
                return not rest or (len(rest) <= 2 and _defines(path, rest[0]))
    return False


def _references(doc: str) -> list[tuple[str, str]]:
    """``(kind, name)`` for every link target, backticked path and backticked package module in ``doc``."""
    text = _strip_fenced(open(os.path.join(ROOT, doc)).read())
    found = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        found.append(("link", target.split("#")[0]))
    for span in CODE.findall(text):
        for token in span.split():
            token = token.strip("(),;:'\"").split("::")[0]
            if MODULE.match(token):
                found.append(("module", token))
            elif _is_path(token):
                found.append(("path", token))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc: str) -> None:
    refs = _references(doc)
    missing = [
        f"{kind} {name}"
        for kind, name in refs
        if not (_module_exists(name) if kind == "module" else _exists(doc, name))
    ]
    assert not missing, f"{doc} names what does not exist:\n" + "\n".join(missing)


def test_the_check_sees_a_missing_path(tmp_path) -> None:
    """The reader finds links, backticked paths and modules, and tells existing from missing ones."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "See [kernels](docs/kernels.md), `benchmarks/nope.py --x 1`, `moe_ep_plugin.recipes.train.cli`, "
        "`moe_ep_plugin.train`, `moe_ep_plugin.config.Config` and `moe_ep_plugin.config.Nope`; `loss.png`, "
        "`DESIGN.md`, `runs/x/`.\n"
        "```\npython3 out/written_by_the_command.py\n```\n"
    )
    refs = _references(os.path.relpath(doc, ROOT))
    assert refs == [
        ("link", "docs/kernels.md"),
        ("path", "benchmarks/nope.py"),
        ("module", "moe_ep_plugin.recipes.train.cli"),
        ("module", "moe_ep_plugin.train"),
        ("module", "moe_ep_plugin.config.Config"),
        ("module", "moe_ep_plugin.config.Nope"),
        ("path", "DESIGN.md"),
    ]
    assert _exists("README.md", "docs/kernels.md") and not _exists("README.md", "benchmarks/nope.py")
    assert _exists("docs/buffer.md", "kernels.md") and not _exists("README.md", "DESIGN.md")
    assert [_module_exists(name) for kind, name in refs if kind == "module"] == [True, False, True, False]


def test_megatron_doc_lists_every_ep_plugin_key() -> None:
    import dataclasses

    from moe_ep_plugin.plugin_options import PluginOptions

    with open(os.path.join(ROOT, "docs", "megatron.md"), encoding="utf-8") as f:
        text = f.read()
    missing = [f.name for f in dataclasses.fields(PluginOptions) if f"| `{f.name}` |" not in text]
    assert not missing, f"docs/megatron.md has no row for ep_plugin keys {missing}"


@pytest.mark.parametrize("needle", ["DESIGN.md", "shared/research"])
def test_no_doc_names_files_a_user_does_not_have(needle: str) -> None:
    docs = [os.path.join(ROOT, "README.md")] + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    naming = [os.path.relpath(d, ROOT) for d in docs if needle in open(d, encoding="utf-8").read()]
    assert not naming, f"{naming} name {needle}"
