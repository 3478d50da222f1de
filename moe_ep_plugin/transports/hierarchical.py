"""The ``hierarchical`` transport: EP groups that span nodes. Each token crosses the network once per target node.

The EP group of R = M x P ranks (M nodes, P ranks each, node-contiguous: group rank ``r`` is local index
``r % P`` on node ``r // P``) is split into two subgroups, each served by an existing transport:

- the **rail group** (the M ranks with this rank's local index, one per node): ``torch`` (NCCL between nodes on
  GPUs, gloo on CPU). Experts are contiguous over ranks, so node ``m`` hosts experts ``[m E/M, (m+1) E/M)``: a
  rail dispatch with ``num_experts = E`` *is* the per-node layout, sends each token once to every node holding
  one of its experts (to the rank with the same local index there) with its top-k ids and weights, and returns
  the ids local to that node.
- the **node group** (the P ranks of this node): ``nvlink`` kernels when they can serve it, else ``torch``. The
  forwarding rank dispatches the rows it received over the rails to the ranks of its node hosting their experts.

Dispatch outputs equal the flat contract (DESIGN.md): rows ordered by source rank, then source token (the node
stage delivers them by (source local index, source node, token); one gather restores the flat order),
``recv_topk_idx`` local to the receiving rank, the per-expert list. A count exchange over the whole group comes
first: every rank checks ids and the ranks' agreement on shapes before any row moves, and the per-rank counts
give the flat ``rank_prefix_matrix`` and the reorder. The source token of each row rides a 16-byte cached node
dispatch (``handle.recv_src_idx``).

Combine (numeric contract): the node group reduces each rail row's copies in fp32 and rounds the per-node
partial to the rows' dtype (BF16 on the wire, as DeepEP's internode combine does); the rail group sums the
partials over nodes (ascending) in fp32, adds the biases and rounds once:
``combined[t] = round(Σ_m round(Σ_{r on node m} x_r[t]) + bias)``. Weights are summed the same way in fp32.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config
from ..handle import DispatchHandle
from ..ops import fp8
from ..ops.layout import count_invalid, invalid_ids_error, send_positions
from .base import DispatchArgs, DispatchResult, Transport
from .torch_transport import _all_gather_single


def node_ids(group: dist.ProcessGroup, ranks_per_node: Optional[int]) -> list[int]:
    """The node of every rank of ``group`` (group rank order): ``ranks_per_node`` when given (emulated nodes),
    else torchrun's ``LOCAL_WORLD_SIZE`` (global ranks are node-contiguous under torchrun), else the hostnames
    gathered over ``group`` (collective). Every rank of ``group`` must call it with the same arguments."""
    num_ranks = dist.get_world_size(group)
    if ranks_per_node is not None:
        if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node <= 0:
            raise ValueError(f"ranks_per_node: expected a positive int, got {ranks_per_node!r}")
        if num_ranks % ranks_per_node:
            raise ValueError(f"ranks_per_node: {ranks_per_node} does not divide the {num_ranks} EP ranks")
        return [r // ranks_per_node for r in range(num_ranks)]
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    if local_world is not None:
        return [g // int(local_world) for g in dist.get_process_group_ranks(group)]
    hosts: list[Optional[str]] = [None] * num_ranks
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    first: dict[str, int] = {}
    return [first.setdefault(h, len(first)) for h in hosts]


def ranks_per_node_of(nodes: list[int]) -> int:
    """P from per-rank node ids; raises unless every node holds the same number of node-contiguous ranks."""
    num_nodes = len(set(nodes))
    per_node = len(nodes) // num_nodes
    if len(nodes) % num_nodes or nodes != [r // per_node for r in range(len(nodes))]:
        raise ValueError(f"the EP group's ranks must fill their nodes evenly and in order (rank r on node r // P); "
                         f"got nodes {nodes}")
    return per_node


@dataclass
class NodeSplit:
    """The node group (this rank's node) and rail group (this local index on every node) of an EP group;
    ``*_ranks`` are global ranks."""

    ranks_per_node: int
    num_nodes: int
    node: int
    local_rank: int
    node_ranks: list[int]
    rail_ranks: list[int]
    node_group: dist.ProcessGroup
    rail_group: dist.ProcessGroup


def split_by_node(group: dist.ProcessGroup, nodes: list[int]) -> NodeSplit:
    """Create the two subgroups from per-rank node ids (:func:`node_ids`). Every rank creates its node group,
    then its rail group, and only members synchronise: EP groups that are subgroups of a larger world
    (Megatron's) need no world-wide order, and node groups are disjoint, so the creation cannot deadlock."""
    per_node = ranks_per_node_of(nodes)
    rank, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    node, local = divmod(rank, per_node)
    node_ranks, rail_ranks = ranks[node * per_node:(node + 1) * per_node], ranks[local::per_node]
    node_group = dist.new_group(node_ranks, use_local_synchronization=True)
    rail_group = dist.new_group(rail_ranks, use_local_synchronization=True)
    return NodeSplit(per_node, len(ranks) // per_node, node, local, node_ranks, rail_ranks, node_group, rail_group)


@dataclass
class _HierState:
    """Replay data: the two stages' handles and the reorder between node-stage and flat row order.

    ``to_flat`` ``[N_recv]`` int64: node-stage row of each flat row; ``to_node`` its inverse."""

    rail_handle: DispatchHandle
    node_handle: DispatchHandle
    to_flat: torch.Tensor
    to_node: torch.Tensor


class HierarchicalTransport(Transport):
    """Rail group (``torch``) between nodes, node group (``nvlink`` or ``torch``) inside; see the module doc.
    ``intra`` serves ``split.node_group``, ``rail`` serves ``split.rail_group``."""

    name = "hierarchical"

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float, split: NodeSplit,
                 intra: Transport, rail: Transport) -> None:
        super().__init__(group, device, timeout_s)
        self.ranks_per_node, self.num_nodes = split.ranks_per_node, split.num_nodes
        self.node, self.local_rank = split.node, split.local_rank
        self.node_ranks, self.rail_ranks = split.node_ranks, split.rail_ranks
        self.intra, self.rail = intra, rail

    def destroy(self) -> None:
        for stage in (self.intra, self.rail):
            release = getattr(stage, "destroy", None)
            if release is not None:
                release()

    def num_tokens_per_node(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """``[N, R]`` bool → ``[M]`` int32: tokens with at least one expert on each node."""
        return self._in_node(is_token_in_rank).sum(0, dtype=torch.int32)

    def _in_node(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        n = is_token_in_rank.shape[0]
        return is_token_in_rank.view(n, self.num_nodes, self.ranks_per_node).any(2)

    def _stage(self, what: str, peers: list[int], fn, *args):
        """Run one stage; a timeout names the stage, this rank and the peers it waited on."""
        try:
            return fn(*args)
        except TimeoutError as exc:
            raise TimeoutError(f"moe_ep_plugin[hierarchical] rank {self.rank}/{self.num_ranks} (node {self.node}, "
                               f"local {self.local_rank}): the {what} stage stalled waiting on global ranks {peers}: "
                               f"{exc}") from exc

    def _exchange_counts(self, args: DispatchArgs) -> torch.Tensor:
        """All-gather over the whole group: each rank's per-rank counts, out-of-range id count and call signature
        (hidden, dtype, top-k width, experts, FP8 flags) → ``[R, R]`` int64 counts on the host; raises the same
        error on every rank if any rank passed bad ids or disagrees."""
        x, topk = args.x, args.topk_idx
        signature = [x.shape[1], _DTYPE_CODES.get(x.dtype, -1), topk.shape[1], args.num_experts,
                     int(args.wire_fp8), int(args.fp8_out), int(args.topk_weights is not None)]
        local = torch.cat([args.num_tokens_per_rank.to(torch.int64).cpu(),
                           count_invalid(topk, args.num_experts).to(torch.int64).cpu(),
                           torch.tensor(signature, dtype=torch.int64)])
        gathered = torch.empty(self.num_ranks, local.numel(), dtype=torch.int64)
        nccl = dist.get_backend(self.group) == "nccl"  # NCCL moves device tensors only; gloo host tensors
        if nccl:
            on_device = gathered.to(self.device)
            work = _all_gather_single(on_device.view(-1), local.to(self.device), group=self.group, async_op=True)
        else:
            work = _all_gather_single(gathered.view(-1), local, group=self.group, async_op=True)
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise TimeoutError(f"moe_ep_plugin[hierarchical] rank {self.rank}/{self.num_ranks}: the dispatch count "
                               f"exchange over the whole EP group did not complete within {self.timeout_s:g} s "
                               f"(a peer rank never joined or failed): {exc}") from exc
        if nccl:
            gathered = on_device.cpu()
        r = self.num_ranks
        bad = gathered[:, r].tolist()
        if any(bad):
            raise invalid_ids_error([i for i, b in enumerate(bad) if b], args.num_experts)
        signatures = gathered[:, r + 1:]
        if not bool((signatures == signatures[0]).all()):
            names = ["hidden", "dtype", "top-k width", "num_experts", "fp8_dispatch", "fp8_out", "topk_weights given"]
            differ = [names[j] for j in range(len(names)) if not bool((signatures[:, j] == signatures[0, j]).all())]
            raise ValueError(f"dispatch: the EP ranks disagree on {differ} (per rank: "
                             f"{signatures[:, [names.index(d) for d in differ]].tolist()}); every rank must pass the "
                             "same hidden size, dtype, top-k width, number of experts and FP8 options")
        return gathered[:, :r]

    def _flat_order(self, counts_to_me: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows from source rank ``s`` arrive from the node stage in (local index, node) order of ``s``; the flat
        contract wants ``s`` ascending. ``counts_to_me[s]``: rows from ``s``. Returns ``(to_flat, to_node)``."""
        p, m = self.ranks_per_node, self.num_nodes
        node_order = [n * p + l for l in range(p) for n in range(m)]
        start, pos = [0] * self.num_ranks, 0
        for s in node_order:
            start[s] = pos
            pos += counts_to_me[s]
        counts = torch.tensor(counts_to_me, dtype=torch.int64)
        flat_start = counts.cumsum(0) - counts
        shift = torch.tensor(start, dtype=torch.int64) - flat_start
        to_flat = torch.arange(pos, dtype=torch.int64) + shift.repeat_interleave(counts)
        to_node = torch.empty_like(to_flat)
        to_node[to_flat] = torch.arange(pos, dtype=torch.int64)
        return to_flat.to(self.device), to_node.to(self.device)

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        cached = args.handle is not None
        x, x_scales = args.x, args.x_scales
        if args.wire_fp8:
            x, x_scales = fp8.quantize(x, round_scale=args.round_scale)
        if cached:
            state: _HierState = args.handle.transport_state
            rail_args = _cached_args(x, x_scales, state.rail_handle, args.config)
        else:
            counts = self._exchange_counts(args)
            in_node = self._in_node(args.is_token_in_rank)
            rail_args = DispatchArgs(
                x=x, x_scales=x_scales, topk_idx=args.topk_idx, topk_weights=args.topk_weights,
                num_tokens_per_rank=in_node.sum(0, dtype=torch.int32), is_token_in_rank=in_node,
                num_experts=args.num_experts, handle=None, num_worst_tokens=0, wire_fp8=False, fp8_out=False,
                round_scale=False, config=args.config)
        rail = self._stage("inter-node (rail group) dispatch", self.rail_ranks, self.rail.dispatch, rail_args)

        node_experts = args.num_experts // self.num_nodes
        if cached:
            node_args = _cached_args(rail.recv_x, rail.recv_scales, state.node_handle, args.config)
        else:
            per_rank, per_expert, in_rank = self.intra.get_dispatch_layout(rail.recv_topk_idx, node_experts)
            node_args = DispatchArgs(
                x=rail.recv_x, x_scales=rail.recv_scales, topk_idx=rail.recv_topk_idx,
                topk_weights=rail.recv_topk_weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_experts=node_experts, handle=None, num_worst_tokens=0, wire_fp8=False, fp8_out=False,
                round_scale=False, config=args.config, num_tokens_per_expert=per_expert)
        node = self._stage("intra-node (node group) dispatch", self.node_ranks, self.intra.dispatch, node_args)

        if cached:
            handle = args.handle
        else:
            counts_to_me = counts[:, self.rank].tolist()
            to_flat, to_node = self._flat_order(counts_to_me)
            # The source token of each row: the rail stage's recv_src_idx, forwarded by the node stage as 16-byte rows.
            src = rail.handle.recv_src_idx.to(torch.int32)
            packed = torch.zeros(src.shape[0], 4, dtype=torch.int32, device=src.device)
            packed[:, 0] = src
            fwd = self._stage("intra-node (node group) source-index", self.node_ranks, self.intra.dispatch,
                              _cached_args(packed.view(torch.bfloat16), None, node.handle, args.config))
            recv_src = fwd.recv_x.view(torch.int32)[:, 0].index_select(0, to_flat).contiguous()
            in_rank = args.is_token_in_rank
            num_recv = len(to_flat)
            handle = DispatchHandle(
                rank_prefix_matrix=counts.cumsum(0).to(torch.int32).to(self.device), is_token_in_rank=in_rank,
                send_pos=send_positions(in_rank), recv_src_idx=recv_src, num_tokens=x.shape[0],
                num_recv_tokens=num_recv, num_experts=args.num_experts, rank=self.rank, num_ranks=self.num_ranks,
                num_recv_rows=max(num_recv, args.num_worst_tokens),
                transport_state=_HierState(rail.handle, node.handle, to_flat, to_node))
        state = handle.transport_state
        num_recv, rows = handle.num_recv_tokens, handle.num_recv_rows
        if rows < num_recv:
            raise ValueError(f"num_worst_tokens={args.num_worst_tokens} is smaller than the {num_recv} rows rank "
                             f"{self.rank} receives")

        recv_x = _reordered(node.recv_x, state.to_flat, rows, 0)
        recv_scales = None if node.recv_scales is None else _reordered(node.recv_scales, state.to_flat, rows, 0)
        if recv_scales is not None and args.wire_fp8 and not args.fp8_out:
            recv_x, recv_scales = fp8.dequantize(recv_x, recv_scales, args.x.dtype), None
        recv_idx = recv_w = expert_counts = host_counts = None
        if not cached:
            recv_idx = _reordered(node.recv_topk_idx, state.to_flat, rows, -1)
            if node.recv_topk_weights is not None:
                recv_w = _reordered(node.recv_topk_weights, state.to_flat, rows, 0)
            expert_counts, host_counts = node.num_recv_tokens_per_expert, node.host_counts
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, expert_counts, handle, host_counts)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor],
                bias: tuple[torch.Tensor, ...], config: Config) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        state: _HierState = handle.transport_state
        num_recv = handle.num_recv_tokens
        x_node = x[:num_recv].index_select(0, state.to_node)
        w_node = None if topk_weights is None else topk_weights[:num_recv].index_select(0, state.to_node)
        # One partial per (token, node), rounded to x.dtype: the bytes that cross the network.
        partial, partial_w = self._stage("intra-node (node group) combine", self.node_ranks, self.intra.combine,
                                         x_node, state.node_handle, w_node, (), config)
        return self._stage("inter-node (rail group) combine", self.rail_ranks, self.rail.combine,
                           partial, state.rail_handle, partial_w, bias, config)


_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, fp8.FP8_DTYPE: 2}


def _cached_args(x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle,
                 config: Config) -> DispatchArgs:
    """A sub-stage replay of ``handle``'s layout: rows (and FP8 scales) only."""
    return DispatchArgs(x=x, x_scales=x_scales, topk_idx=None, topk_weights=None, num_tokens_per_rank=None,
                        is_token_in_rank=None, num_experts=handle.num_experts, handle=handle, num_worst_tokens=0,
                        wire_fp8=False, fp8_out=False, round_scale=False, config=config)


def _reordered(t: torch.Tensor, to_flat: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """Node-stage rows ``t`` in flat order, extended to ``rows`` rows of ``fill`` (``num_worst_tokens``).
    FP8 rows move as bytes (not every device indexes float8 types)."""
    data = t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t
    out = data.new_full((rows,) + tuple(data.shape[1:]), fill)
    out[:to_flat.shape[0]] = data.index_select(0, to_flat)
    return out.view(t.dtype)
