"""benchmarks/deepspeed_compare.py on the CPU: one process, a tiny model, stock DeepSpeed and both plugin variants
in one run; the table comes out, the losses agree, ``--profile`` writes the traces and the layer-part times."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (
    "model.hidden_size=32",
    "model.ffn_hidden_size=48",
    "model.vocab_size=64",
    "model.seq_len=16",
    "moe.num_experts=4",
    "moe.k=2",
    "train.steps=4",
    "train.warmup_steps=1",
    "train.micro_batch_size=4",
)


def test_compare_table_and_profile_on_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "deepspeed_compare.py"),
            "--config",
            os.path.join(ROOT, "configs", "deepspeed_moe.yaml"),
            "--out",
            str(tmp_path),
            "--profile",
            *TINY,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "compare.log").read_text()
    assert "EP 1, E 4, k 2, H 32" in log  # EP1 on one process unless overridden
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(deepspeed|plugin loop|plugin grouped) +(.*)$", log, re.M)}
    assert rows.keys() == {"deepspeed", "plugin loop", "plugin grouped"}, log[-2000:]
    for name, row in rows.items():
        assert row.endswith("yes"), f"{name}: losses differ from stock: {row}"
        assert re.search(r"\d+\.\d\dx", row), row  # the speed-up column
    assert rows["deepspeed"].split()[-5] == "1.00x"
    for part in ("gate", "dispatch", "experts", "combine"):
        assert re.search(rf"^{part} +2\.0 ", log, re.M), f"no host time for {part}"
    assert sorted(os.listdir(tmp_path)) == [
        "compare.log",
        "trace_deepspeed.json",
        "trace_plugin_grouped.json",
        "trace_plugin_loop.json",
    ]
    assert log.strip().splitlines()[-1] in proc.stdout.splitlines()  # the table also goes to the console


def test_unknown_expert_compute_is_a_usage_error(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "deepspeed_compare.py"),
            "--out",
            str(tmp_path),
            "--expert-compute",
            "loop,fast",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "--expert-compute: expected a comma-separated list" in proc.stderr


def test_host_syncs_are_counted_by_their_line(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "deepspeed_compare", os.path.join(ROOT, "benchmarks", "deepspeed_compare.py")
    )
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass looks its module up while being made
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))  # its sibling modules, as when run as a script
    spec.loader.exec_module(bench)
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)  # a CPU build of torch has no CUDA

    def step() -> None:  # what torch's sync debug mode reports for each synchronizing call
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)

    report = bench.host_syncs(step).splitlines()
    line = step.__code__.co_firstlineno + 2
    assert modes == ["warn", "default"]
    assert report[0].endswith(": 3") and report[1].split() == ["3", f"tests/test_deepspeed_compare.py:{line}"]
