"""The MoE layer shape options every benchmark takes, defaulting to the standard shape
(DeepSeek-V3: 4096 tokens per rank, hidden 7168, 256 experts, top-8)."""

import argparse


def add_shape_arguments(
    parser: argparse.ArgumentParser, tokens: int = 4096, hidden: int = 7168, experts: int = 256, topk: int = 8
) -> None:
    """``--tokens`` (per rank), ``--hidden``, ``--experts``, ``--topk`` on ``parser``, with these defaults."""
    parser.add_argument("--tokens", type=int, default=tokens, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--experts", type=int, default=experts)
    parser.add_argument("--topk", type=int, default=topk)
