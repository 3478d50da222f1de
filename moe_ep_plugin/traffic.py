"""Bytes a dispatch sends over the network and over NVLink, flat all-to-all against the hierarchical transport.

Pure tensor ops on one rank's top-k ids (no communication): the trainer's log, ``benchmarks/multinode_traffic.py``
and the hierarchical transport's byte-count test share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NodeTraffic:
    """One source rank's dispatch. ``*_rows`` count sent rows (multiply by the bytes of one row); NVLink rows
    exclude copies a rank makes to itself.

    - flat all-to-all: one row per (token, destination rank); off-node ranks cross the network.
    - hierarchical: one row per (token, remote node) over the network, to the rank with this local index there;
      then, on every target node, the forwarding rank sends one row to each other destination rank of that node.
    """

    num_tokens: int
    nodes_per_token_mean: float
    nodes_per_token_max: int
    flat_network_rows: int
    flat_nvlink_rows: int
    hier_network_rows: int
    hier_nvlink_rows: int


def node_traffic(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int, rank: int
) -> NodeTraffic:
    """``topk_idx`` ``[N, K]`` int (-1 = none) of source rank ``rank``; experts contiguous over ranks, ranks
    contiguous over nodes (rank ``r`` on node ``r // ranks_per_node``)."""
    if num_experts % num_ranks or num_ranks % ranks_per_node:
        raise ValueError(
            f"num_experts={num_experts}, num_ranks={num_ranks}, ranks_per_node={ranks_per_node}: "
            "experts must divide over ranks and ranks over nodes"
        )
    n = topk_idx.shape[0]
    num_nodes, local = num_ranks // ranks_per_node, num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    in_rank = torch.zeros(n, num_ranks + 1, dtype=torch.bool, device="cpu")
    in_rank.scatter_(1, torch.where(valid, topk_idx // local, num_ranks).cpu(), True)
    in_rank = in_rank[:, :num_ranks].view(n, num_nodes, ranks_per_node)
    in_node = in_rank.any(2)  # [N, M]
    my_node, my_local = divmod(rank, ranks_per_node)
    remote = torch.ones(num_nodes, dtype=torch.bool, device="cpu")
    remote[my_node] = False
    ranks_hit = in_rank.sum(2)  # [N, M] destination ranks per node
    nodes = in_node.sum(1)
    forwarder_hit = in_rank[:, :, my_local]  # the rank with my local index is a destination on that node
    return NodeTraffic(
        num_tokens=n,
        nodes_per_token_mean=float(nodes.float().mean()) if n else 0.0,
        nodes_per_token_max=int(nodes.max()) if n else 0,
        flat_network_rows=int(ranks_hit[:, remote].sum()),
        flat_nvlink_rows=int(ranks_hit[:, my_node].sum() - in_rank[:, my_node, my_local].sum()),
        hier_network_rows=int(in_node[:, remote].sum()),
        hier_nvlink_rows=int((ranks_hit - forwarder_hit.to(ranks_hit.dtype)).sum()),
    )
