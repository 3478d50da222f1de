"""Train a small MoE model with deepspeed.initialize; the YAML picks stock DeepSpeed MoE, the plugin's layer, or
DeepSpeed AutoEP (comm_backend deepep on this library, or AutoEP's own comm).

    python examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml                 # spawns train.nprocs ranks
    torchrun --nproc-per-node 2 examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml
    python examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml --compare       # stock, then plugin: table
    python examples/deepspeed_moe.py --config configs/deepspeed_autoep.yaml --compare    # AutoEP comm, then deepep
    python examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml moe.k=1 train.steps=50   # overrides

CPU: gloo ranks (DS_ACCELERATOR=cpu is set here when torch sees no GPU; DeepSpeed compiles no op). GPU: one rank
per GPU, NCCL. A config error is one line naming the key (exit code 2); a failed rank ends the others (exit code 1).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not torch.cuda.is_available():  # DeepSpeed picks its accelerator when imported, in every rank
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from moe_ep_plugin import launch  # noqa: E402
from moe_ep_plugin.recipes.common.yaml_sections import config_error  # noqa: E402
from moe_ep_plugin.recipes.deepspeed.config import compare_configs, load_config  # noqa: E402

PROG = "deepspeed_moe.py"


def _rank_main(config_path: str, overrides: tuple[str, ...], compare: bool) -> None:
    import torch.distributed as dist

    from moe_ep_plugin.recipes.deepspeed.train import main

    main(load_config(config_path, overrides, dist.get_world_size()), compare)


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML run config (configs/deepspeed_*.yaml)")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="train the baseline (stock DeepSpeed MoE; autoep: its comm backend), then this library "
        "(the plugin's layer; autoep: its deepep backend), and print a step-time table",
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value (value parsed as YAML)")
    args = parser.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    try:  # a bad config fails before any rank starts
        cfg = load_config(args.config, tuple(args.overrides), world)
        if args.compare:
            compare_configs(cfg, world)
    except ValueError as exc:
        return config_error(PROG, exc)
    nprocs = world if world is not None else cfg.train.nprocs
    return launch.run_ranks(
        PROG, _rank_main, nprocs, (args.config, tuple(args.overrides), args.compare), timeout_s=cfg.moe.timeout_s
    )


if __name__ == "__main__":
    sys.exit(cli())
