"""docs/compat.md's "Versions tested" table says what CI installs: its ``CI on CPU`` rows of a package (named in
backticks) are exactly the framework versions ``.ci/run`` installs or downloads with ``pip`` (not its lint tools)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Versions tested"
CI = "CI on CPU"
TOOLS = {"ruff", "clang-format"}  # .ci/run's lint tools: no door runs on them
PIN = re.compile(r"([A-Za-z][\w.-]*)==([\w.+]+)")


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def ci_pins(script: str) -> set[tuple[str, str]]:
    """``(package, version)`` of every ``pkg==version`` on a ``pip install``/``pip download`` line of ``script``
    (continuation lines joined), lint tools left out."""
    pins = set()
    for line in script.replace("\\\n", " ").splitlines():
        if re.search(r"\bpip (install|download)\b", line.split("#")[0]):
            pins |= {(name, version) for name, version in PIN.findall(line.split("#")[0]) if name not in TOOLS}
    return pins


def table_rows(doc: str) -> list[list[str]]:
    """The cells of each body row of the first table after ``SECTION`` in ``doc``."""
    after = doc.split(SECTION, 1)[1]
    rows = []
    for line in after.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[2:]  # the header and its rule first


def ci_rows(rows: list[list[str]]) -> set[tuple[str, str]]:
    """``(package, version)`` of the rows run by CI whose framework is a package in backticks (the version: the
    first word of its cell)."""
    out = set()
    for framework, version, _, where in rows:
        package = re.fullmatch(r"`([\w.-]+)`", framework)
        if where == CI and package:
            out.add((package.group(1), version.split()[0]))
    return out


def test_ci_rows_are_what_ci_installs() -> None:
    rows = table_rows(_read("docs/compat.md"))
    assert rows and all(len(row) == 4 for row in rows), rows
    pins = ci_pins(_read(".ci/run"))
    assert ("megatron-core", "0.16.1") in pins and ("megatron-core", "0.19.2") in pins, pins
    documented = ci_rows(rows)
    assert documented == pins, (
        f"docs/compat.md '{SECTION}' names for CI {sorted(documented - pins)} that .ci/run does not install, and "
        f"misses {sorted(pins - documented)} that it does"
    )


def test_the_parsers_on_a_sample() -> None:
    script = 'pip install -q torch==2.13.0 ruff==1.0  # a==9\nDS=0 pip download \\\n  x-y==1.2.3 -d "$D"\necho z==1\n'
    assert ci_pins(script) == {("torch", "2.13.0"), ("x-y", "1.2.3")}
    doc = f"{SECTION}\n\ntext\n\n| a | b | c | d |\n|---|---|---|---|\n| `torch` | 2.13.0 (CPU) | t | {CI} |\n"
    doc += (
        f"| DeepEP | `dd758ca` | t | {CI} |\n| `x-y` | 1.2.3 | t | by hand on CPU |\n\nafter\n| `z` | 1 | t | {CI} |\n"
    )
    assert ci_rows(table_rows(doc)) == {("torch", "2.13.0")}
