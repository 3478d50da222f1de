"""A/B of the trainer's routed-expert GEMMs: the same model from the same seed, trained once per variant, in one run.

Run from the repository root:

    PYTHONPATH=. python3 benchmarks/trainer_ab.py [CONFIG] [section.key=value ...] [--set section.key=value]
        [--variants loop,grouped] [--repeats 2] [--warmup 5] [--out runs/trainer_ab] [--no-plot]

A variant is a value of ``moe.expert_compute`` (``loop``, ``grouped``, ``auto``) applied to CONFIG (default
``configs/ep2_h200.yaml``) and the overrides, which take the trainer CLI's ``section.key=value`` syntax (bare or
after ``--set``). All legs run in one set of ranks (``parallel.nprocs`` spawned here, or torchrun's), alternating
the variants: with ``--repeats 2``, A B A B, so host drift (clocks, other jobs) shows as a spread between the
repeats of one variant rather than as a difference between variants. Each leg builds a fresh ``Trainer`` (weights
from ``train.seed``, the data of step s from ``(seed, s)``, so every leg sees the same model and batches) and runs
the trainer's own step loop, ``Trainer.iter_steps``: its timing, metrics and MFU. Checkpoints are not written.

The table has one row per variant, over all of its legs: tokens/s and ms/step are medians over every step after
the first ``--warmup`` of each leg; MFU is the trainer's (``n/a`` without a known peak, e.g. on CPU); final loss
is its first leg's; max |dloss| is the largest difference over the whole loss curve from the first leg of the
first variant (for the first variant: its own repeats, the run-to-run noise floor); ``vs loop`` is tokens/s over
the loop variant's (over the first variant's when loop is not run); spread is the range of the legs' median
tokens/s over their median.

Writes into ``--out``: ``train.log`` (the trainer's header lines, a line per leg, the table), ``steps.csv`` (every
step of every leg), ``summary.json`` (the table's numbers) and ``loss_curves.png`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import records
import torch.distributed as dist
from tqdm import tqdm

from moe_ep_plugin import launch
from moe_ep_plugin.experts import EXPERT_COMPUTE
from moe_ep_plugin.recipes.common.yaml_sections import config_error
from moe_ep_plugin.recipes.train import config as config_mod
from moe_ep_plugin.recipes.train import metrics
from moe_ep_plugin.recipes.train.trainer import Trainer, preflight, share_cpu_cores

DEFAULT_CONFIG = "configs/ep2_h200.yaml"
PROG = "trainer_ab"
Rows = list[dict[str, Any]]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG | SECTION.KEY=VALUE",
        help=f"a YAML config (default {DEFAULT_CONFIG}) and overrides (values parsed as YAML)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key, as moe-ep-train --set (repeatable)",
    )
    p.add_argument("--variants", default="loop,grouped", help="comma-separated moe.expert_compute values")
    p.add_argument("--repeats", type=int, default=2, help="legs per variant, alternating (A B A B for 2)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each leg left out of the timing")
    p.add_argument("--out", default="runs/trainer_ab", help="output folder")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip loss_curves.png")
    records.add_argument(p)  # after the config and overrides: --record takes the next word as its path
    return p


def leg_configs(
    config_path: str | None, overrides: Sequence[str], variants: Sequence[str], repeats: int, out_dir: str
) -> list[tuple[str, config_mod.TrainerConfig]]:
    """``(variant, config)`` per leg in run order: the variants in turn, ``repeats`` times. ``output.dir`` is
    ``out_dir`` (the trainer's header names it), and no leg resumes: each starts from the seed."""
    if not variants or len(set(variants)) != len(variants) or any(v not in EXPERT_COMPUTE for v in variants):
        raise ValueError(f"--variants: expected distinct values of {EXPERT_COMPUTE}, got {','.join(variants)!r}")
    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats}")
    configs = {
        v: config_mod.load(
            config_path, (*overrides, f"moe.expert_compute={v}", f"output.dir={out_dir}", "output.resume=never")
        )
        for v in variants
    }
    return [(v, configs[v]) for _ in range(repeats) for v in variants]


def summarize(legs: list[tuple[str, Rows]], warmup: int) -> list[dict[str, Any]]:
    """One row per variant (first-run order) from each leg's ``(variant, per-step metrics rows)``."""
    reference = legs[0][1]
    variants = list(dict.fromkeys(v for v, _ in legs))
    baseline = "loop" if "loop" in variants else variants[0]
    table = []
    for variant in variants:
        runs = [rows for v, rows in legs if v == variant]
        timed = [r for rows in runs for r in rows[warmup:]]
        mfus = [r["mfu"] for r in timed if r["mfu"] is not None]
        per_leg = [statistics.median(r["tokens_per_s"] for r in rows[warmup:]) for rows in runs]
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
        table.append(
            {
                "variant": variant,
                "legs": len(runs),
                "tokens_per_s": tokens_per_s,
                "ms_per_step": 1e3 * statistics.median(r["step_time_s"] for r in timed),
                "mfu": statistics.median(mfus) if mfus else None,
                "final_loss": runs[0][-1]["loss"],
                "max_abs_loss_diff": max(
                    abs(a["loss"] - b["loss"]) for rows in runs for a, b in zip(rows, reference, strict=True)
                ),
                "leg_spread": (max(per_leg) - min(per_leg)) / statistics.median(per_leg),
            }
        )
    base = next(row["tokens_per_s"] for row in table if row["variant"] == baseline)
    for row in table:
        row["ratio"], row["baseline"] = row["tokens_per_s"] / base, baseline
    return table


def format_table(table: list[dict[str, Any]]) -> list[str]:
    """The summary as aligned text lines."""
    lines = [
        f"{'variant':<8} {'tokens/s':>11} {'ms/step':>9} {'MFU':>6} {'final loss':>11} {'max|dloss|':>10} "
        f"{'vs ' + table[0]['baseline']:>8} {'spread':>7}"
    ]
    for r in table:
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(
            f"{r['variant']:<8} {r['tokens_per_s']:>11,.0f} {r['ms_per_step']:>9.2f} {mfu:>6} "
            f"{r['final_loss']:>11.6f} {r['max_abs_loss_diff']:>10.2e} {r['ratio']:>7.3f}x "
            f"{100 * r['leg_spread']:>6.1f}%"
        )
    return lines


def write_steps(path: str, legs: list[tuple[str, Rows]]) -> None:
    """Every step of every leg: ``leg, variant`` and the trainer's ``metrics.csv`` columns."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=("leg", "variant") + metrics.COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for leg, (variant, rows) in enumerate(legs, 1):
            writer.writerows(
                {"leg": leg, "variant": variant, **{k: ("" if v is None else v) for k, v in r.items()}} for r in rows
            )


def write_plot(path: str, legs: list[tuple[str, Rows]]) -> str | None:
    """Loss of every leg, its difference from the first leg, and tokens/s over the steps. None when written, else
    why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'moe_ep_plugin[plots]')"
    reference = [r["loss"] for r in legs[0][1]]
    fig, (ax_loss, ax_diff, ax_speed) = plt.subplots(3, 1, figsize=(8, 9), sharex=True, height_ratios=(3, 1.5, 1.5))
    for leg, (variant, rows) in enumerate(legs, 1):
        steps, losses = [r["step"] for r in rows], [r["loss"] for r in rows]
        # later legs dashed, so curves that coincide stay visible on top of each other
        style = "-" if leg == 1 else "--"
        ax_loss.plot(steps, losses, style, label=f"leg {leg}: {variant}")
        ax_diff.plot(steps, [a - b for a, b in zip(losses, reference, strict=True)], style)
        ax_speed.plot(steps, [r["tokens_per_s"] for r in rows], style)
    ax_loss.set_ylabel("train loss")
    ax_loss.legend()
    ax_diff.set_ylabel(f"loss - leg 1 ({legs[0][0]})")
    ax_speed.set_ylabel("tokens/s")
    ax_speed.set_xlabel("step")
    for ax in (ax_loss, ax_diff, ax_speed):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_legs(
    legs: list[tuple[str, config_mod.TrainerConfig]],
    out_dir: str,
    warmup: int,
    plot: bool,
    command: str,
    record: argparse.Namespace,
) -> None:
    """Per-rank entry point: train every leg in turn on the default group; rank 0 reports into ``out_dir`` (and,
    with ``record.record``, the grouped variant against the loop into benchmarks/results.jsonl)."""
    lead = dist.get_rank() == 0
    share_cpu_cores(legs[0][1])
    logger: logging.Logger | None = None
    if lead:
        os.makedirs(out_dir, exist_ok=True)
        logger = metrics.make_logger(out_dir, to_console=True)
        logger.info(f"{PROG}: {command}")
    bar = tqdm(total=sum(cfg.train.steps for _, cfg in legs), disable=not lead, unit="step", dynamic_ncols=True)
    results: list[tuple[str, Rows]] = []
    for leg, (variant, cfg) in enumerate(legs, 1):
        trainer = Trainer(cfg)
        try:
            if lead and leg == 1:
                trainer.log_header(logger)
            bar.set_description(f"leg {leg}/{len(legs)} {variant}")
            rows: Rows = []
            for row in trainer.iter_steps(cfg.train.steps):
                rows.append(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}")
        finally:
            trainer.buffer.destroy()
        del trainer  # frees this leg's model and optimizer state before the next leg builds its own
        results.append((variant, rows))
        if lead:
            timed = rows[warmup:]
            diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, results[0][1], strict=True))
            logger.info(
                f"leg {leg}/{len(legs)} moe.expert_compute={variant}: median "
                f"{statistics.median(r['tokens_per_s'] for r in timed):,.0f} tok/s over steps "
                f"{warmup + 1}-{len(rows)}, final loss {rows[-1]['loss']:.6f}, max |dloss| vs leg 1 {diff:.2e}"
            )
    bar.close()
    if not lead:
        return
    table = summarize(results, warmup)
    for line in format_table(table):
        logger.info(line)
    speed = {row["variant"]: row["tokens_per_s"] for row in table}
    if {"grouped", "loop"} <= speed.keys():
        records.record(
            record,
            "trainer_ab",
            {"config": record.config, "ranks": dist.get_world_size()},
            round(speed["grouped"]),
            round(speed["loop"]),
            "tokens/s",
        )
    write_steps(os.path.join(out_dir, "steps.csv"), results)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(
            {"command": command, "warmup": warmup, "legs": [v for v, _ in results], "variants": table}, f, indent=1
        )
    why_not = write_plot(os.path.join(out_dir, "loss_curves.png"), results) if plot else "--no-plot"
    logger.info(f"plot skipped: {why_not}" if why_not else f"plot: {os.path.join(out_dir, 'loss_curves.png')}")
    logger.info(f"outputs in {out_dir}: train.log, steps.csv, summary.json")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    paths = [a for a in args.args if "=" not in a]
    overrides = [a for a in args.args if "=" in a] + args.overrides
    try:
        if len(paths) > 1:
            raise ValueError(f"config: expected one YAML file, got {paths}")
        legs = leg_configs(
            paths[0] if paths else DEFAULT_CONFIG, overrides, args.variants.split(","), args.repeats, args.out
        )
        steps = legs[0][1].train.steps
        if not 0 <= args.warmup < steps:
            raise ValueError(f"--warmup: must be in [0, train.steps={steps}) to leave a timed step, got {args.warmup}")
        backend = preflight(legs[0][1])
    except ValueError as exc:
        return config_error(PROG, exc)
    cfg = legs[0][1]
    command = " ".join(["benchmarks/trainer_ab.py", *(argv if argv is not None else sys.argv[1:])])
    record = argparse.Namespace(record=args.record, config=paths[0] if paths else DEFAULT_CONFIG)
    return launch.run_ranks(
        PROG,
        run_legs,
        cfg.parallel.nprocs,
        (legs, args.out, args.warmup, args.plot, command, record),
        backend=backend,
        timeout_s=cfg.parallel.timeout_s,
    )


if __name__ == "__main__":
    sys.exit(main())
