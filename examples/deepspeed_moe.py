"""Train a small MoE model with deepspeed.initialize; the YAML picks stock DeepSpeed MoE or the plugin.

    python examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml                 # spawns train.nprocs ranks
    torchrun --nproc-per-node 2 examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml
    python examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml --compare       # stock, then plugin: table
    python examples/deepspeed_moe.py --config configs/deepspeed_moe.yaml moe.k=1 train.steps=50   # overrides

CPU: gloo ranks (set DS_ACCELERATOR=cpu to skip DeepSpeed's accelerator probe warning). GPU: one rank per GPU, NCCL.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from moe_ep_plugin import launch  # noqa: E402
from moe_ep_plugin.deepspeed.config import load_config  # noqa: E402


def _rank_main(config_path: str, overrides: tuple[str, ...], compare: bool) -> None:
    import torch.distributed as dist

    from moe_ep_plugin.deepspeed.train import main
    main(load_config(config_path, overrides, dist.get_world_size()), compare)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config (configs/deepspeed_*.yaml)")
    parser.add_argument("--compare", action="store_true",
                        help="train with stock DeepSpeed MoE, then with the plugin, and print a step-time table")
    parser.add_argument("overrides", nargs="*", help="section.key=value (value parsed as YAML)")
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    cfg = load_config(args.config, tuple(args.overrides), world)  # a bad config fails before any rank starts
    nprocs = world if world is not None else cfg.train.nprocs
    launch.launch(_rank_main, nprocs, (args.config, tuple(args.overrides), args.compare), timeout_s=600)


if __name__ == "__main__":
    cli()
