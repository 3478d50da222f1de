"""``moe-ep-train [CONFIG.yaml] [--set section.key=value ...] [--until STEP] [--dry-run] [--list-keys]``,
``moe-ep-train --plot RUN_DIR``.

Without torchrun it spawns ``parallel.nprocs`` local ranks itself; under torchrun it joins torchrun's ranks.
Without a config file it trains the built-in defaults (identical to ``configs/tiny.yaml``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from ... import launch
from ..common.yaml_sections import CONFIG_ERROR_EXIT, config_error
from . import config as config_mod
from . import metrics
from .trainer import preflight, run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-ep-train",
        description="Train a DeepSeek-V3-style MoE model with expert parallelism through moe_ep_plugin.",
    )
    p.add_argument("config", nargs="?", help="YAML config (default: the built-in tiny config)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key, e.g. --set train.steps=50 (repeatable; the value is parsed as YAML)",
    )
    p.add_argument(
        "--until",
        type=int,
        metavar="STEP",
        help="stop after this step with a checkpoint (a later run resumes; the LR schedule still follows train.steps)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config, build the model on the meta device and print its size, then exit",
    )
    p.add_argument(
        "--plot",
        metavar="RUN_DIR",
        help="(re)draw loss.png and expert_load.png from a run directory's CSV files, then exit",
    )
    p.add_argument("--list-keys", action="store_true", help="print every config key with its default and meaning")
    return p


def dry_run(cfg: config_mod.TrainerConfig) -> str:
    """Parameter counts of rank 0 of ``parallel.nprocs`` without allocating (meta device)."""
    from .model import MoETransformer  # imported here so --list-keys works without building anything

    ep = cfg.parallel.nprocs
    with torch.device("meta"):
        model = MoETransformer(cfg, 0, ep)
    replicated = sum(p.numel() for p in model.replicated_parameters())
    experts = sum(p.numel() for p in model.expert_parameters())
    m, e = cfg.model, cfg.moe
    return (
        f"config OK: {m.num_layers} blocks ({m.num_dense_layers} dense), hidden {m.hidden_size}, "
        f"{e.num_experts} routed experts (top-{e.topk}, {e.num_groups} groups / top-{e.group_topk}) + "
        f"{e.num_shared_experts} shared, EP {ep} → {e.num_experts // ep} experts per rank\n"
        f"parameters per rank: {replicated / 1e6:,.1f}M replicated + {experts / 1e6:,.1f}M own experts; "
        f"whole model {(replicated + experts * ep) / 1e9:,.2f}B"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list_keys:
        for key, tname, default, doc in config_mod.schema():
            print(f"{key} ({tname}, default {default!r}): {doc}")
        return 0
    if args.plot:
        why_not = metrics.write_plots(args.plot)
        print(
            f"moe-ep-train: plots not written: {why_not}" if why_not else f"wrote {args.plot}/loss.png, expert_load.png"
        )
        return 1 if why_not else 0
    if args.until is not None and args.until < 1:
        print(f"moe-ep-train: --until must be >= 1, got {args.until}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        cfg = config_mod.load(args.config, tuple(args.overrides))
        backend = preflight(cfg)
        if args.dry_run:
            print(dry_run(cfg))
            return 0
    except ValueError as exc:
        return config_error("moe-ep-train", exc)
    return launch.run_ranks(
        "moe-ep-train", run, cfg.parallel.nprocs, (cfg, args.until), backend=backend, timeout_s=cfg.parallel.timeout_s
    )


if __name__ == "__main__":
    sys.exit(main())
