"""benchmarks/plot_results.py reads the stored GPU logs exactly and draws them; malformed logs are clear errors."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import plot_results  # noqa: E402

RUNS = os.path.join(ROOT, "benchmarks", "gpu_runs")
KERNELS = os.path.join(RUNS, "2026-11-30_s3_kernels_bench.log")
MEGATRON = os.path.join(RUNS, "2026-11-30_s3_megatron.log")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_parses_the_final_runs_numbers() -> None:
    assert plot_results.kernel_times(_read(KERNELS)) == {"layout": 4.3, "FP8 dispatch": 182.0, "BF16 dispatch": 244.7,
                                                         "BF16 combine": 263.4}
    table = plot_results.dispatcher_times(_read(MEGATRON))
    assert set(table) == {"alltoall", "ep_plugin:torch", "ep_plugin:nvlink", "ep_plugin:nvlink:fp8", "flex_plugin"}
    assert table["ep_plugin:nvlink"][4096] == pytest.approx((1.7051, 3.6967))
    assert table["alltoall"][128] == pytest.approx((2.728, 5.4344))


def test_malformed_logs_name_the_argument() -> None:
    with pytest.raises(ValueError, match="--kernels"):
        plot_results.kernel_times("no table here")
    with pytest.raises(ValueError, match="--megatron"):
        plot_results.dispatcher_times("no table here")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed ([plots] extra)")
def test_writes_a_png(tmp_path) -> None:
    out = tmp_path / "summary.png"
    plot_results.plot(plot_results.kernel_times(_read(KERNELS)), plot_results.dispatcher_times(_read(MEGATRON)),
                      "test", str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
