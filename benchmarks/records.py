"""Benchmark results as data: ``--record`` appends one JSON object per measured case to ``benchmarks/results.jsonl``.

``benchmarks/render_results.py`` renders RESULTS.md and the README's performance table from that file, so a figure is
written once, by the run that measured it. A script adds the flag with :func:`add_argument` and calls :func:`record`
once per case; without ``--record`` nothing is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATH = ROOT / "benchmarks" / "results.jsonl"
KINDS = ("measured", "predicted", "test")


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Adds --record [PATH]: append one JSON object per measured case to PATH (default benchmarks/results.jsonl)."""
    parser.add_argument(
        "--record",
        nargs="?",
        const=str(DEFAULT_PATH),
        default=None,
        metavar="PATH",
        help="append one JSON object per measured case to PATH (default benchmarks/results.jsonl)",
    )


def _commit() -> str:
    """The repository's short HEAD; copies of the tree without .git name theirs through MOE_EP_COMMIT."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    commit = os.environ.get("MOE_EP_COMMIT", "").strip()
    if not commit:
        raise ValueError(
            f"record: {ROOT} is not a git checkout; set MOE_EP_COMMIT to the commit the tree was copied from"
        )
    return commit


def _command() -> str:
    """The command line as run: ``python3`` + the script path relative to the repository root + its arguments."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_name = str(script.relative_to(ROOT))
    except ValueError:  # a script outside the tree (a copy, a test driver): its name as given
        script_name = sys.argv[0]
    return shlex.join(["python3", script_name, *sys.argv[1:]])


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def machine(num_gpus: int) -> str:
    """The device as results.jsonl names a run on GPUs: the GPU's model and how many the run used
    (``nvidia-h200-x2``), so a run replaces the rows of the last run on the same kind of machine."""
    import torch

    model = "-".join(torch.cuda.get_device_name().lower().split()[:2])  # "NVIDIA H100 80GB HBM3": nvidia-h100
    return f"{model}-x{num_gpus}"


def reference(path: str | Path, benchmark: str, configuration: dict, device: str) -> float | None:
    """The stock figure of the newest row of ``path`` with this benchmark, configuration and device, or None: a
    reference measured in its own run (another library's benchmark), carried to the row of a new plugin run."""
    if not Path(path).exists():
        return None
    found: dict | None = None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line) if line.strip() else None
        if row and (row["benchmark"], row["configuration"], row["device"]) == (benchmark, configuration, device):
            if found is None or row["date"] >= found["date"]:
                found = row
    return None if found is None else found["stock"]


def record(
    args: argparse.Namespace,
    benchmark: str,
    configuration: dict,
    plugin: float | None,
    stock: float | None,
    unit: str,
    kind: str = "measured",
    device: str | None = None,
) -> None:
    """No-op unless args.record is set. Appends {benchmark, date (UTC YYYY-MM-DD), device (default:
    torch.cuda.get_device_name() or 'cpu'), commit, command, configuration, plugin, stock, unit, kind} as one line.
    kind in measured|predicted|test (anything else: ValueError naming kind)."""
    if kind not in KINDS:  # checked with or without --record, so a typo fails on the first run
        raise ValueError(f"record: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    bad = {k: v for k, v in configuration.items() if not isinstance(v, str | int | float | bool | type(None))}
    if bad:  # the rendering keys its rows by the configuration: nested values would not compare as one key
        raise ValueError(f"record: configuration must be flat (str, int, float, bool or None values), got {bad}")
    path = getattr(args, "record", None)
    if not path:
        return
    row = {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": device if device is not None else _device(),
        "commit": _commit(),
        "command": _command(),
        "configuration": configuration,
        "plugin": plugin,
        "stock": stock,
        "unit": unit,
        "kind": kind,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
