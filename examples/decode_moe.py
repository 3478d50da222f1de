"""Greedy decoding with the example trainer's model, its MoE layers on low-latency mode, checked against the
normal-mode forward of the same model on the same Buffer (``moe_ep_plugin.recipes.train.decode``).

    python examples/decode_moe.py                                   # configs/tiny.yaml defaults, 2 CPU ranks
    python examples/decode_moe.py configs/tiny.yaml --new-tokens 8 --set parallel.nprocs=4
    torchrun --nproc-per-node 2 examples/decode_moe.py configs/ep2_h200.yaml --set model.hidden_size=2048

Rank 0 prints one table, a row per rank: the largest difference of a low-latency MoE block from its normal-mode
forward, of the decoded logits from the normal-mode forward of the whole sequence, and of a CUDA-graph replay from
eager steps; then a PASS/FAIL line. Every rank fails when a difference is over its tolerance.
"""

from __future__ import annotations

import argparse

from moe_ep_plugin import launch
from moe_ep_plugin.recipes.train import config, trainer
from moe_ep_plugin.recipes.train.decode import decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=None, help="YAML config (default: configs/tiny.yaml's values)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank (= tokens per rank per step)")
    parser.add_argument("--prompt-len", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--cuda-graph", action="store_true", help="capture one step and replay it (GPU)")
    args = parser.parse_args()
    cfg = config.load(args.config, tuple(args.set))
    return launch.run_ranks(
        "decode_moe.py",
        decode,
        cfg.parallel.nprocs,
        (cfg, args.batch, args.prompt_len, args.new_tokens, args.cuda_graph),
        backend=trainer.resolve_backend(cfg),
        timeout_s=cfg.parallel.timeout_s,
    )


if __name__ == "__main__":
    raise SystemExit(main())
