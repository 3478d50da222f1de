"""Stock DeepSpeed MoE against the plugin's MoE layer in one run: the DeepSpeed example's model, weights, data and
gate noise (``moe_ep_plugin.recipes.deepspeed.train``), trained once per variant with ``deepspeed.initialize``.

    python benchmarks/deepspeed_compare.py                        # EP1 on one GPU, configs/deepspeed_moe_gpu.yaml
    python benchmarks/deepspeed_compare.py --profile              # + torch.profiler traces and where the time goes
    python benchmarks/deepspeed_compare.py moe.ep_size=2 train.nprocs=2      # EP2 on 2 GPUs (or torchrun)
    python benchmarks/deepspeed_compare.py --config configs/deepspeed_moe.yaml train.steps=10   # CPU, gloo

Variants: ``deepspeed`` (stock ``deepspeed.moe.layer.MoE``), then ``plugin <expert_compute>`` for each entry of
``--expert-compute`` (``loop``: DeepSpeed's expert modules one by one; ``grouped``: one grouped GEMM per
projection over the stacked expert weights; ``auto``). Overrides are ``section.key=value`` as for
``examples/deepspeed_moe.py``; ``moe.ep_size=1 train.nprocs=1`` come first, so EP1 on one device is the default.

The table (printed by rank 0 and written to ``--out``/compare.log): ms per step (median over the steps after
``train.warmup_steps``, slowest rank), steps/s, speed-up over stock, first and last loss, and whether every
step's loss agrees with stock's (relative ``2e-4`` in FP32, where only summation order differs; ``2e-2`` in BF16,
where that order changes roundings). ``--profile`` runs a few more steps of each variant under
``torch.profiler``, writes ``--out``/trace_<variant>.json (chrome://tracing, Perfetto) and prints the top ops by
self device and host time, the host time of each part of the MoE layers' forward (gate, dispatch,
all_to_all, experts, combine; one ``record_function`` range each) and, on CUDA, the host syncs of one more step
by the line of Python that made them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import records
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not torch.cuda.is_available():  # DeepSpeed picks its accelerator when imported, in every rank
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from moe_ep_plugin import launch  # noqa: E402
from moe_ep_plugin.experts import EXPERT_COMPUTE  # noqa: E402
from moe_ep_plugin.recipes.common.yaml_sections import config_error  # noqa: E402
from moe_ep_plugin.recipes.deepspeed.config import RunConfig, load_config  # noqa: E402

PROG = "deepspeed_compare.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(REPO, "configs", "deepspeed_moe_gpu.yaml")
EP1 = ("moe.ep_size=1", "train.nprocs=1")
PROFILE_STEPS = 3
LOSS_RTOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}
TOP_OPS = 15
PART_PREFIX = "moe::"


@dataclass
class Measured:
    """One variant's run."""

    name: str
    transport: str
    losses: list[float]
    step_times_s: list[float]
    profile: str = ""  # rank 0's profiler report


def variants(cfg: RunConfig, expert_computes: list[str]) -> dict[str, RunConfig]:
    """Stock DeepSpeed, then the plugin with each ``expert_compute``; everything else as configured."""
    runs = {"deepspeed": dataclasses.replace(cfg, dispatcher="deepspeed", moe=cfg.moe.stock())}
    for impl in expert_computes:
        runs[f"plugin {impl}"] = dataclasses.replace(
            cfg, dispatcher="plugin", moe=dataclasses.replace(cfg.moe, expert_compute=impl)
        )
    return runs


def _ranged(name: str, fn: Callable) -> Callable:
    """``fn`` inside a profiler range ``name``."""

    @functools.wraps(fn)
    def ranged(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return ranged


def _part_targets() -> list[tuple[str, object, str]]:
    """``(range, owner, attribute)`` of each part of the stock and the plugin layer's forward."""
    from deepspeed.moe import experts as ds_experts
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    import moe_ep_plugin.autograd as ep_autograd
    from moe_ep_plugin.deepspeed import layer as plugin_layer

    names = ("layer", "gate", "gate", "dispatch", "dispatch", "all_to_all", "experts", "experts", "combine", "combine")
    targets = (
        (DeepSpeedMoE, "forward"),
        (sharded_moe.TopKGate, "forward"),
        (plugin_layer, "route"),
        (sharded_moe, "_sparse_encode"),
        (ep_autograd, "dispatch_experts"),
        (sharded_moe._AllToAll, "apply"),
        (ds_experts.Experts, "forward"),
        (plugin_layer.PluginMOELayer, "run_experts"),
        (sharded_moe, "_sparse_decode"),
        (ep_autograd, "combine_experts"),
    )
    return [(PART_PREFIX + name, owner, attr) for name, (owner, attr) in zip(names, targets, strict=True)]


@contextlib.contextmanager
def part_ranges() -> Iterator[None]:
    """Each part of the layers' forward in a profiler range of its own (patched in, restored after)."""
    missing = object()
    saved = []
    try:
        for name, owner, attr in _part_targets():
            saved.append((owner, attr, vars(owner).get(attr, missing)))
            setattr(owner, attr, _ranged(name, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, raw in reversed(saved):
            if raw is missing:
                delattr(owner, attr)  # it was inherited (autograd.Function.apply)
            else:
                setattr(owner, attr, raw)


def profile_report(prof: torch.profiler.profile, steps: int, cuda: bool) -> str:
    """Top ops by self device time (CUDA) and self host time, then the host time (and on CUDA the device time of
    the kernels it launched) of each layer part per step."""
    events = prof.key_averages()
    sections = []
    if cuda:
        sections += [
            f"top {TOP_OPS} ops by self device time",
            events.table(sort_by="self_device_time_total", row_limit=TOP_OPS),
        ]
    sections += [f"top {TOP_OPS} ops by self host time", events.table(sort_by="self_cpu_time_total", row_limit=TOP_OPS)]
    parts = sorted((e for e in events if e.key.startswith(PART_PREFIX)), key=lambda e: -e.cpu_time_total)
    lines = [
        f"host time of the MoE layers' forward parts, per step (all layers), over {steps} steps",
        f"{'part':<16}{'calls/step':>11}{'ms/step':>10}{'us/call':>10}" + (f"{'device ms/step':>16}" if cuda else ""),
    ]
    lines += [
        f"{e.key[len(PART_PREFIX) :]:<16}{e.count / steps:>11.1f}{e.cpu_time_total / steps / 1e3:>10.2f}"
        f"{e.cpu_time_total / max(e.count, 1):>10.1f}" + (f"{e.device_time_total / steps / 1e3:>16.2f}" if cuda else "")
        for e in parts
    ]
    return "\n".join(sections + lines)


def host_syncs(step: Callable[[], object]) -> str:
    """The synchronizing CUDA calls of one ``step()`` (``torch.cuda.set_sync_debug_mode``), counted by the line of
    Python that made them, most frequent first."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(
        f"{os.path.relpath(w.filename, REPO)}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)
    )
    lines = [f"host syncs in one step (torch.cuda sync debug mode): {sum(sites.values())}"]
    lines += [f"{count:>6}  {site}" for site, count in sites.most_common(TOP_OPS)]
    return "\n".join(lines)


def run_variant(name: str, cfg: RunConfig, out_dir: str, profile: bool) -> Measured:
    """Train ``train.steps`` steps of ``cfg`` (tqdm bar on rank 0); with ``profile`` then :data:`PROFILE_STEPS`
    more under ``torch.profiler`` (rank 0 writes the trace)."""
    import torch.distributed as dist
    from tqdm import tqdm

    from moe_ep_plugin.buffer_cache import cached_transports
    from moe_ep_plugin.recipes.deepspeed.train import build_engine, train_steps

    rank0 = dist.get_rank() == 0
    engine = build_engine(cfg)
    losses, times = [], []
    with tqdm(total=cfg.train.steps, desc=f"{name:<16}", disable=not rank0, unit="step", dynamic_ncols=True) as bar:
        for step in range(cfg.train.steps):
            result = train_steps(engine, cfg, step, 1)
            losses += result.losses
            times += result.step_times_s
            bar.set_postfix_str(f"loss {losses[-1]:.4f}, {1e3 * times[-1]:.1f} ms")
            bar.update()
    transport = "padded all_to_all" if cfg.dispatcher == "deepspeed" else "+".join(cached_transports())
    measured = Measured(name, transport + (" fp8" if cfg.moe.fp8_dispatch else ""), losses, times)
    if profile:
        cuda = engine.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with (
            part_ranges(),
            torch.profiler.profile(activities=activities) if rank0 else contextlib.nullcontext() as prof,
        ):
            train_steps(engine, cfg, cfg.train.steps, PROFILE_STEPS)
        if rank0:
            trace = os.path.join(out_dir, f"trace_{name.replace(' ', '_')}.json")
            prof.export_chrome_trace(trace)
            measured.profile = f"{profile_report(prof, PROFILE_STEPS, cuda)}\ntrace: {trace}"
        if cuda:
            syncs = host_syncs(lambda: train_steps(engine, cfg, cfg.train.steps + PROFILE_STEPS, 1))
            if rank0:
                measured.profile += "\n" + syncs
    engine.destroy()
    return measured


def median_s(cfg: RunConfig, run: Measured) -> float:
    """``run``'s median seconds per step after the warm-up steps."""
    return statistics.median(run.step_times_s[cfg.train.warmup_steps :] or run.step_times_s)


def format_table(cfg: RunConfig, runs: list[Measured]) -> str:
    """ms/step, steps/s, speed-up over the first run (stock), losses and their agreement with it."""
    rtol = LOSS_RTOL[cfg.train.torch_dtype()]
    base = runs[0]
    lines = [
        f"{'variant':<18}{'transport':<20}{'ms/step':>9}{'steps/s':>9}{'vs stock':>10}{'first loss':>12}"
        f"{'last loss':>11}{'max rel loss diff':>19}  losses equal (rtol {rtol:g})"
    ]
    for run in runs:
        diff = max(abs(a - b) / abs(b) for a, b in zip(run.losses, base.losses, strict=True))
        t = median_s(cfg, run)
        lines.append(
            f"{run.name:<18}{run.transport:<20}{1e3 * t:>9.2f}{1 / t:>9.2f}{median_s(cfg, base) / t:>9.2f}x"
            f"{run.losses[0]:>12.4f}{run.losses[-1]:>11.4f}{diff:>19.2e}  {'yes' if diff <= rtol else 'NO'}"
        )
    return "\n".join(lines)


def header(cfg: RunConfig) -> str:
    """What ran where: versions, device, shape."""
    import deepspeed
    import torch.distributed as dist

    m, device = cfg.moe, ("cuda: " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    return (
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, {device}, world {dist.get_world_size()}, "
        f"backend {dist.get_backend()}\n"
        f"EP {m.ep_size}, E {m.num_experts}, k {m.k}, H {cfg.model.hidden_size}, F {cfg.model.ffn_hidden_size}, "
        f"{cfg.model.num_layers} MoE layers, tokens/rank/step {cfg.train.micro_batch_size * cfg.model.seq_len}, "
        f"{cfg.train.torch_dtype()}, ZeRO {cfg.deepspeed.get('zero_optimization', {}).get('stage', 0)}, "
        f"{cfg.train.steps} steps, median over steps {cfg.train.warmup_steps}..{cfg.train.steps - 1}"
    )


def _rank_main(
    config_path: str,
    overrides: tuple[str, ...],
    expert_computes: list[str],
    out_dir: str,
    profile: bool,
    record: argparse.Namespace,
) -> None:
    import torch.distributed as dist
    from tqdm import tqdm

    from moe_ep_plugin.deepspeed import destroy_buffers
    from moe_ep_plugin.recipes.deepspeed.train import init_deepspeed_comm

    cfg = load_config(config_path, overrides, dist.get_world_size())
    init_deepspeed_comm()
    rank0 = dist.get_rank() == 0
    log = open(os.path.join(out_dir, "compare.log"), "w", encoding="utf-8") if rank0 else None

    def emit(text: str) -> None:
        tqdm.write(text)
        log.write(text + "\n")
        log.flush()

    try:
        if rank0:
            emit(header(cfg))
        runs = []
        for name, run_cfg in variants(cfg, expert_computes).items():
            runs.append(run_variant(name, run_cfg, out_dir, profile))
            if rank0:
                run = runs[-1]
                emit(
                    f"{name}: losses {' '.join(f'{v:.4f}' for v in run.losses)}\n{name}: ms/step "
                    f"{' '.join(f'{1e3 * t:.1f}' for t in run.step_times_s)}"
                )
                if run.profile:
                    emit(run.profile)
        if rank0:
            emit(format_table(cfg, runs))
            for run in runs[1:]:  # every plugin variant against the stock layer (runs[0])
                records.record(
                    record,
                    "deepspeed_compare",
                    {"ep": cfg.moe.ep_size, "variant": run.name.removeprefix("plugin ")},
                    round(1e3 * median_s(cfg, run), 1),
                    round(1e3 * median_s(cfg, runs[0]), 1),
                    "ms/step",
                )
    finally:
        destroy_buffers()
        if log is not None:
            log.close()


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run config (default: %(default)s)")
    parser.add_argument(
        "--expert-compute",
        default="loop,grouped",
        help="comma-separated plugin variants: loop, grouped, auto (default: %(default)s)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"profile {PROFILE_STEPS} more steps of each variant: traces, top ops, layer parts",
    )
    parser.add_argument(
        "--out",
        default=os.path.join("runs", "deepspeed_compare"),
        help="where compare.log and the traces go (default: %(default)s)",
    )
    parser.add_argument("overrides", nargs="*", help=f"section.key=value (value parsed as YAML), after {' '.join(EP1)}")
    records.add_argument(parser)
    args = parser.parse_args(argv)
    overrides = EP1 + tuple(args.overrides)
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    expert_computes = [v for v in args.expert_compute.split(",") if v]
    unknown = [v for v in expert_computes if v not in EXPERT_COMPUTE]
    if unknown or not expert_computes:
        parser.error(
            f"--expert-compute: expected a comma-separated list of {', '.join(EXPERT_COMPUTE)}, "
            f"got {args.expert_compute!r}"
        )
    try:  # a bad config fails before any rank starts
        cfg = load_config(args.config, overrides, world)
    except ValueError as exc:
        return config_error(PROG, exc)
    os.makedirs(args.out, exist_ok=True)
    nprocs = world if world is not None else cfg.train.nprocs
    return launch.run_ranks(
        PROG,
        _rank_main,
        nprocs,
        (args.config, overrides, expert_computes, args.out, args.profile, argparse.Namespace(record=args.record)),
        timeout_s=cfg.moe.timeout_s,
    )


if __name__ == "__main__":
    sys.exit(cli())
