"""benchmarks/plot_results.py, run as a script on excerpts of real GPU logs: it reads the numbers exactly, draws
them, and names the argument of a malformed log."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "plot_results.py")

# Excerpts of the kernel benchmark's and the dispatcher harness's console logs (2 x H200, 2026-11-30).
KERNELS_LOG = """\
nvlink 24 SMs                        4096 graph kernel layout          4.3             -              -
nvlink 24 SMs                        4096 graph kernel dispatch fp8     182.0           328            164
nvlink 24 SMs                        4096 graph kernel dispatch bf16     244.7           473            237
nvlink 24 SMs                        4096 graph kernel combine bf16     263.4           440            220
nvlink 24 SMs                        4096 graph kernel experts dispatch bf16     420.5           275            138
"""
MEGATRON_LOG = """\
kind                 | tokens | fwd us | fwd+bwd us | correct
alltoall             | 4096   | 4707.9 | 9386.0     | True
ep_plugin:nvlink     | 4096   | 1705.1 | 3696.7     | True
alltoall             | 128    | 2728.0 | 5434.4     | True
ep_plugin:nvlink     | 128    | 630.8  | 1982.2     | True
"""


def _run(tmp_path, kernels: str, megatron: str) -> subprocess.CompletedProcess:
    (tmp_path / "kernels.log").write_text(kernels)
    (tmp_path / "megatron.log").write_text(megatron)
    return subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--kernels",
            str(tmp_path / "kernels.log"),
            "--megatron",
            str(tmp_path / "megatron.log"),
            "--out",
            str(tmp_path / "summary.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed ([plots] extra)")
def test_reads_the_logs_exactly_and_writes_a_png(tmp_path) -> None:
    proc = _run(tmp_path, KERNELS_LOG, MEGATRON_LOG)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:4] == [
        "kernel layout: 4.3 us",
        "kernel FP8 dispatch: 182.0 us",
        "kernel BF16 dispatch: 244.7 us",
        "kernel BF16 combine: 263.4 us",
    ]
    assert lines[4:8] == [
        "dispatcher alltoall 128: fwd 2.7280 ms, fwd+bwd 5.4344 ms",
        "dispatcher alltoall 4096: fwd 4.7079 ms, fwd+bwd 9.3860 ms",
        "dispatcher ep_plugin:nvlink 128: fwd 0.6308 ms, fwd+bwd 1.9822 ms",
        "dispatcher ep_plugin:nvlink 4096: fwd 1.7051 ms, fwd+bwd 3.6967 ms",
    ]
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("which", ["--kernels", "--megatron"])
def test_a_malformed_log_names_its_argument(tmp_path, which: str) -> None:
    proc = _run(
        tmp_path,
        "no table here" if which == "--kernels" else KERNELS_LOG,
        "no table here" if which == "--megatron" else MEGATRON_LOG,
    )
    assert proc.returncode == 2 and f"error: {which}:" in proc.stderr, proc.stderr
    assert not (tmp_path / "summary.png").exists()
