"""The README's sample run is what ``moe-ep-train`` prints: the first 10 steps (``--until 10``, the same LR schedule
as the full run) give the README's set-up lines and its step-10 line, but for the times and the tokens/s (the CPU
run is deterministic). The README's step-300 lines come from one full run (the README says which)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TIME = re.compile(r"^\d\d:\d\d:\d\d ")
_RATE = re.compile(r"[\d,]+ tok/s")


def _readme_sample() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text[text.index("`moe-ep-train` spawns 2 ranks") :]
    block = block[block.index("```\n") + 4 :]
    return [line for line in block[: block.index("```")].splitlines() if _TIME.match(line)]


def _comparable(line: str) -> str:
    return _RATE.sub("N tok/s", _TIME.sub("", line))


def test_the_readme_sample_run_is_what_prints(tmp_path) -> None:
    sample = _readme_sample()
    lines = [_comparable(line) for line in sample]
    want = [line for line in lines if not re.match(r"step +\d+/", line) or line.startswith("step  10/")][:5]
    code = "import sys; from moe_ep_plugin.recipes.train import cli; sys.exit(cli.main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "--until", "10", "--set", "output.progress_bar=false"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [_comparable(line) for line in proc.stdout.splitlines() if _TIME.match(line)][:5]
    assert got == want, "\n".join(got)
