"""The rows ``--record`` writes for bench_dispatch_combine.py and mcore_dispatchers.py (GPU scripts; their row
building is plain Python): figures paired with their stock, wrong results left out, and the configurations named
as benchmarks/results.jsonl names them, so a new run's rows replace the last run's in the rendering."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the scripts import as they run
import bench_dispatch_combine  # noqa: E402
import mcore_dispatchers  # noqa: E402
import records  # noqa: E402


def _data_configs(benchmark: str, **where: object) -> list[dict]:
    rows = [json.loads(line) for line in (BENCHMARKS / "results.jsonl").read_text(encoding="utf-8").splitlines()]
    return [
        r["configuration"]
        for r in rows
        if r["benchmark"] == benchmark and all(r["configuration"].get(k) == v for k, v in where.items())
    ]


def _timed(tag: str, tokens: int, ops: dict[str, float]) -> list[dict]:
    return [dict(tag=tag, tokens=tokens, op=op, us=us) for op, us in ops.items()]


def test_dispatch_combine_rows_pair_the_same_run_or_carry_deepep_reference(tmp_path: Path) -> None:
    ok = [dict(tag="nvlink 24 SMs", tokens=4096, op="check vs torch", ok=True)]
    results = (
        ok
        + _timed("nvlink 24 SMs", 4096, {"dispatch bf16": 480.04, "graph kernel layout": 4.2, "kernel layout": 9.0})
        + _timed("nvlink 24 SMs", 4096, {"graph kernel dispatch bf16": 224.61})
        + _timed("torch (NCCL)", 4096, {"dispatch bf16": 1900.0, "layout": 300.0})
        + _timed("nvlink 24 SMs", 1024, {"dispatch bf16": 100.0})  # the sweep: printed only
    )
    graph_bf16 = {"ep": 2, "tokens": 4096, "sms": 24, "timing": "graph", "stock path": "DeepEP V1 (its own run)"}
    graph_bf16["op"] = "BF16 dispatch"
    data = tmp_path / "results.jsonl"
    lines = [
        dict(benchmark="bench_dispatch_combine", date=date, device=device, configuration=graph_bf16, stock=stock)
        for date, device, stock in (("2026-12-01", "x", 344), ("2026-11-01", "x", 300), ("2026-12-02", "y", 1))
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    rows = bench_dispatch_combine.record_rows(results, 4096, 24, 2, "x", str(data))
    assert [(c["timing"], c["op"], plugin, stock) for c, plugin, stock in rows] == [
        ("api", "BF16 dispatch, fresh", 480.0, 1900.0),  # layout: no plugin figure, no row
        ("graph", "layout", 4.2, None),  # no DeepEP reference for it in the data
        ("graph", "BF16 dispatch", 224.6, 344),  # the newest reference on the same device
    ]
    assert rows[0][0] == {
        "ep": 2,
        "tokens": 4096,
        "sms": 24,
        "timing": "api",
        "stock path": "torch transport (NCCL)",
        "op": "BF16 dispatch, fresh",
    }
    failed = [dict(ok[0], ok=False)] + results[1:]
    assert bench_dispatch_combine.record_rows(failed, 4096, 24, 2, "x", str(data)) == []


def test_dispatch_combine_run_replaces_every_recorded_row(tmp_path: Path) -> None:
    ops = {op: 1.0 for op in bench_dispatch_combine.API_OPS} | {op: 1.0 for op in bench_dispatch_combine.GRAPH_OPS}
    results = [dict(tag="nvlink 24 SMs", tokens=4096, op="check vs torch", ok=True)]
    results += _timed("nvlink 24 SMs", 4096, ops) + _timed("torch (NCCL)", 4096, ops)
    made = [c for c, _, _ in bench_dispatch_combine.record_rows(results, 4096, 24, 2, "x", str(tmp_path / "none"))]
    recorded = _data_configs("bench_dispatch_combine", ep=2, sms=24, tokens=4096)
    assert recorded and all(c in made for c in recorded)


@pytest.mark.parametrize(
    ("kind", "world", "label"),
    [
        ("ep_plugin:nvlink", 1, "ep_plugin (local)"),
        ("ep_plugin:torch:fp8", 1, "ep_plugin:fp8 (local)"),
        ("ep_plugin:nvlink:fp8", 2, "ep_plugin:nvlink:fp8"),
        ("ep_plugin:torch", 2, "ep_plugin:torch (NCCL)"),
        ("flex_plugin", 2, "flex + this library"),
    ],
)
def test_mcore_kind_labels(kind: str, world: int, label: str) -> None:
    assert mcore_dispatchers.kind_label(kind, world) == label


def test_mcore_rows_against_alltoall() -> None:
    timed = {
        ("alltoall", 128): {"fwd": 300.0, "fwd+bwd": 700.0, "graph fwd": 90.0},
        ("ep_plugin:nvlink", 128): {"fwd": 1189.04, "fwd+bwd": 2474.0, "graph fwd": 309.0},
        ("flex", 128): {"fwd": 1.0, "fwd+bwd": 1.0},  # Megatron's own: no row
        ("ep_plugin:nvlink", 4096): {"fwd": 4115.0, "fwd+bwd": 8807.0},  # alltoall failed here: no stock
    }
    rows = mcore_dispatchers.record_rows(timed, 1, 1.0)
    assert rows[0] == (
        "mcore_drop_and_pad",
        {"ep": 1, "tokens": 128, "kind": "ep_plugin (local)", "capacity factor": 1.0, "phase": "fwd"},
        1189.0,
        300.0,
    )
    assert [(c["tokens"], c["phase"], stock) for _, c, _, stock in rows[1:]] == [
        (128, "fwd+bwd", 700.0),
        (128, "graph fwd", 90.0),
        (4096, "fwd", None),
        (4096, "fwd+bwd", None),
    ]
    assert {b for b, _, _, _ in mcore_dispatchers.record_rows(timed, 1, 0.0)} == {"mcore_dispatchers"}
    budgeted = mcore_dispatchers.record_rows(timed, 1, 0.0, 1.5)  # the ep_plugin kinds' row budget is named
    assert {b for b, _, _, _ in budgeted} == {"mcore_dispatchers"}
    assert all(c["recv capacity factor"] == 1.5 and "capacity factor" not in c for _, c, _, _ in budgeted)


@pytest.mark.parametrize(
    ("name", "world", "kinds", "pad", "phases"),
    [
        (
            "mcore_dispatchers",
            2,
            ("alltoall", "ep_plugin:torch", "ep_plugin:nvlink", "ep_plugin:nvlink:fp8", "flex_plugin"),
            0.0,
            ("fwd", "fwd+bwd"),
        ),
        ("mcore_drop_and_pad", 1, ("alltoall", "ep_plugin:nvlink"), 1.0, ("fwd", "fwd+bwd", "graph fwd")),
    ],
)
def test_mcore_run_replaces_every_recorded_row(
    name: str, world: int, kinds: tuple[str, ...], pad: float, phases: tuple[str, ...]
) -> None:
    timed = {(kind, tokens): dict.fromkeys(phases, 1.0) for kind in kinds for tokens in (4096, 128)}
    made = [c for _, c, _, _ in mcore_dispatchers.record_rows(timed, world, pad)]
    recorded = _data_configs(name, ep=world)
    assert recorded and all(c in made for c in recorded)


def test_machine_names_the_model_and_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert records.machine(1) == "nvidia-h100-x1"
