"""Render benchmarks/RESULTS.md and the README's performance table from benchmarks/results.jsonl.

Every row of the data file is one measured (or predicted) case as ``benchmarks/records.py`` writes it. The
rendering keeps the newest row per (benchmark, configuration, device) (the later line of one date wins), computes
each ratio from the two figures, and never puts a prediction in a column of measurements. Usage:
``python3 benchmarks/render_results.py`` writes both files; ``--check`` writes nothing and exits 1 naming the
files that differ from the rendering (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "results.jsonl"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
THROUGHPUT_UNITS = ("tokens/s", "GB/s")  # higher is better: the time ratio is stock / plugin


@dataclass(frozen=True)
class Table:
    """One benchmark's section of RESULTS.md: what it measures and the command that reproduces it."""

    benchmark: str
    title: str
    about: str
    command: str


# The order of RESULTS.md; a benchmark in the data without an entry here is an error (say what it measures).
TABLES = (
    Table(
        "bench_dispatch_combine",
        "Kernels: `bench_dispatch_combine.py`",
        "Dispatch and combine through the `Buffer` API (`timing: api`, stock the `torch` transport over NCCL in "
        "the same run) and the kernels' own GPU time from CUDA-graph replay (`timing: graph`, stock DeepEP V1 "
        "measured on the same machine kind in its own run: a reference, not a same-run ratio).",
        "python3 benchmarks/bench_dispatch_combine.py",
    ),
    Table(
        "sm_sweep",
        "SM sweep: `sm_sweep.py`",
        "The dispatch and combine kernels at S SMs with 2 or 4 ranks sharing one GPU (MPS), GB/s of remote bytes "
        "per rank from CUDA-graph replay; stock the copy kernel of `nvlink_ceiling.cu` writing the same bytes into "
        "the peers' staging regions with the same S (copy rows: the copy alone, at more SMs, and the copy engines). "
        "The bytes never cross NVLink: the kernels' SM-bound throughput and their distance from a copy, not the "
        "link's speed.",
        "python3 benchmarks/sm_sweep.py --ranks 2   # and --ranks 4; an MPS daemon running",
    ),
    Table(
        "sm_sweep, shared-memory copy stages",
        "SM sweep of the kernels without register spills (not kept)",
        "The dispatch and combine kernels rebuilt so that no specialisation spills (each copy batch staged in shared "
        "memory by `cp.async` instead of registers; commit 93aa4ba, in the history without its changes), swept in "
        "the same call on the same GPU as the current kernels' rows of the table above, outputs bit-exact: no "
        "faster, up to a tenth slower at 8 SMs, so not kept.",
        "python3 benchmarks/sm_sweep.py --ranks 2 --sms 8,24 --tokens 4096   # and --ranks 4, on commit 93aa4ba",
    ),
    Table(
        "sm_sweep, abe3312 kernels",
        "SM sweep of commit abe3312's kernels",
        "The same sweep over the code whose EP 2 kernel times across two H200s are the `timing: graph` rows above "
        "(its Python and kernels, copy yardstick left out); what `benchmarks/ep_model.py --check` fits.",
        "OLD_TREE=<abe3312 checkout, library built> python3 benchmarks/sm_sweep_baseline.py --ranks 2 --sms 8,24 "
        "--tokens 4096,1024",
    ),
    Table(
        "fresh_dispatch_host",
        "Fresh dispatch, host time: `fresh_dispatch_host.py`",
        "A dispatch without a handle on `nvlink`, ranks sharing one GPU: host time from the call to the dispatch "
        "kernel's launch, split (notify, receive allocation), the wait for the counts that follows the launch, and "
        "the cached dispatch's call to launch beside it. No stock path.",
        "python3 benchmarks/fresh_dispatch_host.py --ranks 2   # an MPS daemon running",
    ),
    Table(
        "host_overhead",
        "Host time per layer: `host_overhead.py`",
        "Python/CPU time per call of each layer of the Megatron dispatcher path (cumulative), one process on the "
        "CPU; `local` does the one-rank transport's real work, `stand-in` replays recorded results so the layers "
        "above the transport are timed alone. No stock path.",
        "PYTHONPATH=. python3 benchmarks/host_overhead.py",
    ),
    Table(
        "gpu_tests",
        "GPU test suites",
        "Pass or fail of a GPU suite (rendered in the last section).",
        "docs/gpu_testing.md",
    ),
    Table(
        "bench_permute",
        "Expert-major permute: `bench_permute.py`",
        "The permute kernels against the torch-op fallback on the same inputs (same bits), one GPU.",
        "python3 benchmarks/bench_permute.py",
    ),
    Table(
        "bench_low_latency",
        "Low-latency mode: `bench_low_latency.py`",
        "Dispatch + combine, each call in its own CUDA graph; stock the torch collective form of the same calls "
        "(at EP1 since the `local` transport: its normal-mode path).",
        "python3 benchmarks/bench_low_latency.py --sweep 1,8,32,128,256",
    ),
    Table(
        "mcore_dispatchers",
        "Megatron-Core dispatchers: `mcore_dispatchers.py`",
        "The dispatcher's forward and forward + backward with identity experts (megatron-core 0.19.2), stock "
        "Megatron's `alltoall` dispatcher in the same process.",
        "torchrun --nproc-per-node R benchmarks/mcore_dispatchers.py --tokens 4096,128 --breakdown",
    ),
    Table(
        "mcore_drop_and_pad",
        "Megatron-Core drop-and-pad: `mcore_dispatchers.py --pad-capacity 1.0`",
        "The same with `moe_pad_expert_input_to_capacity` (capacity factor 1.0); `graph fwd` replays the forward "
        "captured in one CUDA graph.",
        "torchrun --nproc-per-node 1 benchmarks/mcore_dispatchers.py --kinds alltoall,ep_plugin:nvlink "
        "--pad-capacity 1.0 --tokens 4096,128 --cuda-graph",
    ),
    Table(
        "deepspeed_compare",
        "DeepSpeed MoE layer: `deepspeed_compare.py`",
        "Stock `deepspeed.moe.layer.MoE` against the plugin's `MoE` trained from the same weights and data "
        "(`configs/deepspeed_moe_gpu.yaml`), median ms per step after warm-up.",
        "python3 benchmarks/deepspeed_compare.py",
    ),
    Table(
        "trainer_ab",
        "Example trainer: `trainer_ab.py`",
        "The example trainer's loop at one rank, alternating legs: grouped expert GEMMs (plugin) against the "
        "per-expert loop (stock), median tokens/s.",
        "python3 benchmarks/trainer_ab.py configs/ep2_h200.yaml parallel.nprocs=1",
    ),
    Table(
        "nvlink_ceiling",
        "NVLink ceilings: `nvlink_ceiling.cu`",
        "What the link between two GPUs carries, 57 MB per direction; no stock path.",
        "python3 benchmarks/nvlink_ceiling.py   # builds and runs nvlink_ceiling.cu",
    ),
    Table(
        "multinode_traffic",
        "Multi-node traffic model: `multinode_traffic.py`",
        "Bytes one rank sends per dispatch from DeepSeek-V3 routing, 4096 tokens per rank, 8 GPUs per node, "
        "50 GB/s network, 160 GB/s NVLink; plugin the `hierarchical` transport, stock the flat all-to-all.",
        "python3 benchmarks/multinode_traffic.py",
    ),
    Table(
        "hierarchical_overlap",
        "Hierarchical stage overlap: `hierarchical_overlap.py`",
        "`Config.hierarchical_chunks` against one exchange (stock), CPU gloo, 2 x 2 emulated nodes, dispatch + "
        "combine.",
        "python3 benchmarks/hierarchical_overlap.py --serial",
    ),
)
# The README's performance table: (benchmark, configuration filter); a filter value that is a tuple matches any of it.
README_ROWS = (
    (
        "bench_dispatch_combine",
        {
            "timing": "graph",
            "op": (
                "layout",
                "FP8 dispatch, rows quantized beforehand",
                "FP8 dispatch, BF16 rows quantized in the send path",
                "BF16 dispatch",
                "BF16 combine",
            ),
        },
    ),
    ("sm_sweep", {"ranks": 2, "tokens": 4096, "sms": (8, 24)}),
    ("mcore_dispatchers", {"kind": ("ep_plugin:nvlink", "ep_plugin (local)"), "tokens": 4096}),
    ("mcore_drop_and_pad", {"tokens": 4096}),
    ("deepspeed_compare", {"variant": "grouped"}),
    ("trainer_ab", {}),
)


def load(path: Path) -> list[dict]:
    """The rows of ``path`` (one JSON object a line), checked for the fields the rendering reads."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {
            "benchmark",
            "date",
            "device",
            "commit",
            "command",
            "configuration",
            "plugin",
            "stock",
            "unit",
            "kind",
        } - row.keys()
        if missing:
            raise ValueError(f"{path.name}:{number}: missing {sorted(missing)}")
        if row["kind"] not in ("measured", "predicted", "test"):
            raise ValueError(f"{path.name}:{number}: kind must be measured, predicted or test, got {row['kind']!r}")
        rows.append(row)
    return rows


def newest(rows: list[dict]) -> list[dict]:
    """The newest row per (benchmark, configuration, device), in the order the keys first appear."""
    kept: dict[tuple, dict] = {}
    for row in rows:
        key = (row["benchmark"], json.dumps(row["configuration"], sort_keys=True), row["device"])
        if key not in kept or row["date"] >= kept[key]["date"]:
            kept[key] = row
    return list(kept.values())


def ratio(row: dict) -> float | None:
    """Plugin time / stock time (below 1: the plugin is faster); for a throughput, stock / plugin."""
    plugin, stock = row["plugin"], row["stock"]
    if plugin is None or stock is None or not plugin or not stock:
        return None
    return stock / plugin if row["unit"] in THROUGHPUT_UNITS else plugin / stock


def _number(value: float | None) -> str:
    return "–" if value is None else format(value, ",.10g")


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}" if value < 0.1 else f"{value:.2f}"


def _cell(value: object) -> str:
    return "–" if value is None else str(value).replace("|", "\\|")


def _table(rows: list[dict]) -> list[str]:
    """Markdown rows: date, device, commit, the configuration's keys (their union, first seen first), the figures."""
    keys = list(dict.fromkeys(k for row in rows for k in row["configuration"]))
    unit = " / ".join(dict.fromkeys(row["unit"] for row in rows))
    lines = [
        "| date | device | commit | " + " | ".join(keys) + f" | plugin ({unit}) | stock ({unit}) | ratio |",
        "|---|---|---|" + "---|" * len(keys) + "---:|---:|---:|",
    ]
    for row in sorted(rows, key=lambda r: r["date"], reverse=True):
        config = [_cell(row["configuration"].get(k)) for k in keys]
        lines.append(
            f"| {row['date']} | {row['device']} | `{row['commit']}` | "
            + " | ".join(config)
            + f" | {_number(row['plugin'])} | {_number(row['stock'])} | {_ratio(ratio(row))} |"
        )
    return lines


def render_results(rows: list[dict]) -> str:
    """RESULTS.md: per benchmark its measured table, then its predictions in a table of their own."""
    known = {t.benchmark for t in TABLES}
    unknown = sorted({r["benchmark"] for r in rows} - known)
    if unknown:
        raise ValueError(f"benchmarks without a table in render_results.TABLES: {unknown}")
    current = newest(rows)
    out = [
        "# Current results",
        "",
        "Rendered by `python3 benchmarks/render_results.py` from `benchmarks/results.jsonl` (a benchmark run "
        "with `--record` appends its rows there); do not edit by hand. Each table holds the newest row per "
        "configuration and device; earlier rows stay in the data file and in git. **Ratio** = plugin time / stock "
        "time in the same run (for a throughput, stock / plugin), below 1: the plugin is faster. How to run each "
        "command on a GPU host: [docs/gpu_testing.md](../docs/gpu_testing.md).",
        "",
    ]
    for table in TABLES:
        mine = [r for r in current if r["benchmark"] == table.benchmark]
        measured = [r for r in mine if r["kind"] == "measured"]
        predicted = [r for r in mine if r["kind"] == "predicted"]
        if not measured and not predicted:
            continue
        out += [f"## {table.title}", "", f"{table.about} Command: `{table.command}`.", ""]
        if measured:
            out += _table(measured) + [""]
        if predicted:
            out += ["Predictions (a model, not a measurement):", ""] + _table(predicted) + [""]
    tests = [r for r in current if r["kind"] == "test"]
    if tests:
        out += ["## GPU test suites", ""]
        out += [
            f"- {_cell(r['configuration'].get('suite'))}: {'passed' if r['plugin'] else 'failed'} "
            f"({r['date']}, {r['device']}, `{r['commit']}`; `{r['command']}`)"
            for r in tests
        ] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def _matches(row: dict, benchmark: str, where: dict) -> bool:
    if row["benchmark"] != benchmark or row["kind"] != "measured":
        return False
    return all(row["configuration"].get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in where.items())


def render_readme_table(rows: list[dict]) -> str:
    """The README's performance table: the README_ROWS' newest measured rows."""
    current = newest(rows)
    lines = [
        "| benchmark | configuration | date, device | commit | plugin | stock | unit | ratio |",
        "|---|---|---|---|---:|---:|---|---:|",
    ]
    for benchmark, where in README_ROWS:
        for row in (r for r in current if _matches(r, benchmark, where)):
            config = ", ".join(f"{k} {v}" for k, v in row["configuration"].items())
            lines.append(
                f"| `{benchmark}` | {_cell(config)} | {row['date']}, {row['device']} | `{row['commit']}` | "
                f"{_number(row['plugin'])} | {_number(row['stock'])} | {row['unit']} | "
                f"{_ratio(ratio(row))} |"
            )
    return "\n".join(lines) + "\n"


def render_readme(readme: str, table: str) -> str:
    """``readme`` with the text between the marker comments replaced by ``table``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise ValueError(f"README.md: expected one {BEGIN} before one {END}")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files that differ")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    rows = load(args.data)
    rendered = {
        args.results: render_results(rows),
        args.readme: render_readme(args.readme.read_text(encoding="utf-8"), render_readme_table(rows)),
    }
    differ = [path for path, text in rendered.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if args.check:
        if differ:
            print(
                "render_results: differ from the rendering of "
                f"{args.data}: " + ", ".join(str(p) for p in differ) + " (run python3 benchmarks/render_results.py)",
                file=sys.stderr,
            )
            return 1
        return 0
    for path in differ:
        path.write_text(rendered[path], encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
