"""Dispatch traffic per rank across nodes: flat all-to-all vs. the hierarchical transport (a model, no network).

DeepSeek-V3 routing: 256 experts, top-8, 8 groups, sigmoid scores (``gating.group_limited_topk``, Megatron-Core
semantics), on random logits plus a fixed per-expert skew (N(0, 0.5), a few popular experts as in a trained
router), with and without the group limit (``group_topk`` 4). EP 16..256 with 8 GPUs per node. For each EP size
the bytes a rank sends over the network and over NVLink (``traffic.node_traffic``, averaged over 16 source ranks,
4096 tokens each) for BF16 rows of hidden 7168 plus top-k metadata, and the time a simple link model gives:

- flat all-to-all: network and NVLink legs run concurrently: ``max(net / B_net, nvl / B_nvl)``;
- hierarchical, as built (network stage, then the NVLink forward): ``net / B_net + nvl / B_nvl``;
- hierarchical with the two stages fully overlapped by chunks (what a fused kernel gets): the ``max``.

B_net = 50 GB/s per GPU (one 400 Gb/s NIC per GPU), B_nvl = 160 GB/s per GPU (what DeepEP's intranode kernels
reach on H800/H200 NVLink). Combine moves the same rows backwards (BF16), so it is the same table.

Usage: ``python benchmarks/multinode_traffic.py [--tokens 4096] [--plot benchmarks/multinode_traffic.png]``
"""

from __future__ import annotations

import argparse

import records
import torch

from moe_ep_plugin.gating import group_limited_topk
from moe_ep_plugin.traffic import node_traffic

EXPERTS, TOPK, GROUPS, GROUP_TOPK, HIDDEN = 256, 8, 8, 4, 7168
GPUS_PER_NODE = 8
EP_SIZES = (16, 32, 64, 128, 256)
NET_GBPS, NVL_GBPS = 50.0, 160.0
ROW_BYTES = HIDDEN * 2 + (2 * TOPK + 1) * 4  # BF16 row + top-k ids, source index and weights (int32 words)
SOURCES = 16


def routing(tokens: int, group_topk: int | None, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    skew = torch.randn(EXPERTS, generator=torch.Generator().manual_seed(0)) * 0.5
    logits = torch.randn(tokens, EXPERTS, generator=gen) + skew
    _, idx = group_limited_topk(logits, TOPK, score_function="sigmoid", num_groups=GROUPS, group_topk=group_topk)
    return idx


def rows(ep: int, tokens: int, group_topk: int | None) -> dict[str, float]:
    """Mean rows per source rank (and nodes per token) over ``SOURCES`` source ranks spread over the nodes."""
    sources = range(0, ep, max(1, ep // SOURCES))
    acc = dict(flat_net=0.0, flat_nvl=0.0, hier_net=0.0, hier_nvl=0.0, nodes_mean=0.0, nodes_max=0)
    for s in sources:
        t = node_traffic(routing(tokens, group_topk, seed=s + 1), EXPERTS, ep, GPUS_PER_NODE, s)
        acc["flat_net"] += t.flat_network_rows
        acc["flat_nvl"] += t.flat_nvlink_rows
        acc["hier_net"] += t.hier_network_rows
        acc["hier_nvl"] += t.hier_nvlink_rows
        acc["nodes_mean"] += t.nodes_per_token_mean
        acc["nodes_max"] = max(acc["nodes_max"], t.nodes_per_token_max)
    n = len(sources)
    return {key: (value if key == "nodes_max" else value / n) for key, value in acc.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--plot", default="benchmarks/multinode_traffic.png")
    records.add_argument(parser)
    args = parser.parse_args()
    mb = ROW_BYTES / 1e6
    print(
        f"{args.tokens} tokens/rank, hidden {HIDDEN} BF16 ({ROW_BYTES} B/row with metadata), {EXPERTS} experts "
        f"top-{TOPK}, {GROUPS} groups, {GPUS_PER_NODE} GPUs/node; "
        f"links {NET_GBPS:g} GB/s net, {NVL_GBPS:g} GB/s NVLink"
    )
    header = (
        "| EP | nodes | routing | nodes/token mean (max) | flat net MB | flat NVL MB | hier net MB | hier NVL MB "
        "| net bytes saved | flat ms | hier ms (serial) | hier ms (overlapped) |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    results = []
    for group_topk in (None, GROUP_TOPK):
        for ep in EP_SIZES:
            r = rows(ep, args.tokens, group_topk)
            fnet, fnvl, hnet, hnvl = (r[k] * mb for k in ("flat_net", "flat_nvl", "hier_net", "hier_nvl"))
            flat_ms = max(fnet / NET_GBPS, fnvl / NVL_GBPS)  # MB / (GB/s) = ms
            serial_ms = hnet / NET_GBPS + hnvl / NVL_GBPS
            overlap_ms = max(hnet / NET_GBPS, hnvl / NVL_GBPS)
            label = "top-8" if group_topk is None else f"group top-{group_topk}"
            saved = 1 - hnet / fnet if fnet else 0.0
            print(
                f"| {ep} | {ep // GPUS_PER_NODE} | {label} | {r['nodes_mean']:.2f} ({r['nodes_max']}) | {fnet:.1f} | "
                f"{fnvl:.1f} | {hnet:.1f} | {hnvl:.1f} | {saved:.0%} | {flat_ms:.2f} | {serial_ms:.2f} | "
                f"{overlap_ms:.2f} |"
            )
            results.append((label, ep, flat_ms, serial_ms, overlap_ms))
            # the transport as built runs its two stages one after the other: the serial figure is its prediction
            records.record(
                args,
                "multinode_traffic",
                {"ep": ep, "nodes": ep // GPUS_PER_NODE, "routing": label},
                round(serial_ms, 2),
                round(flat_ms, 2),
                "ms",
                kind="predicted",
                device="cpu",
            )
    if args.plot:
        _plot(results, args.plot)
        print(f"plot: {args.plot}")


def _plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, label in zip(axes, ("top-8", f"group top-{GROUP_TOPK}"), strict=True):
        picked = [r for r in results if r[0] == label]
        eps = [r[1] for r in picked]
        for col, name, style in (
            (2, "flat all-to-all", "o-"),
            (3, "hierarchical (serial)", "s-"),
            (4, "hierarchical (overlapped)", "^--"),
        ):
            ax.plot(eps, [r[col] for r in picked], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(eps, [str(e) for e in eps])
        ax.set_title(f"DeepSeek-V3 routing, {label}")
        ax.set_xlabel("EP size (8 GPUs per node)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dispatch time per rank, link model (ms)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
