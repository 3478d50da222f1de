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

Dispatch outputs equal the flat contract (docs/buffer.md): rows ordered by source rank, then source token (the node
stage delivers them by (source local index, source node, token); one gather restores the flat order),
``recv_topk_idx`` local to the receiving rank, the per-expert list. A count exchange over the whole group comes
first: every rank checks ids and the ranks' agreement on shapes before any row moves, and the per-rank counts
give the flat ``rank_prefix_matrix``. The source token and rank of each row ride a 16-byte cached node dispatch
(``handle.recv_src_idx``; sorting by them gives the flat order).

Chunks (``Config.hierarchical_chunks`` = C): each rank's tokens are split into C contiguous chunks, and each chunk
passes through both stages with its own sub-stage handles; the rail exchange of chunk i + 1 is in flight
(asynchronous collectives: ``Transport.start_dispatch``) while the node stage of chunk i runs, and combine runs the
node reduction of chunk i while the partials of chunk i - 1 cross the rails. Every token lies in one chunk, so
rows, handles and sums are those of C = 1 (the stages one after the other), bit for bit.

Combine (numeric contract): the node group reduces each rail row's copies in fp32 from 0 and rounds the per-node
partial to the rows' dtype (BF16 on the wire, as DeepEP's internode combine does); the rail group sums the
partials over nodes in fp32 from the biases and rounds once:
``combined[t] = round(bias + Σ_m round(Σ_{r on node m} x_r[t]))``, both sums in ``summing_order`` (ranks of a node
by the last top-k slot naming them, nodes likewise): DeepEP V2's hybrid combine. Weights are summed the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import Config, positive_int
from ..handle import DispatchHandle
from ..ops import fp8, permute
from ..ops.layout import count_invalid, invalid_ids_error, send_positions
from .base import DispatchArgs, DispatchResult, Transport, negative_counts_error, refusal_code, refused
from .torch_transport import TorchTransport

# Where a rank's node layout comes from: the word each rank sends in the layout exchange (its value beside it).
_LAYOUT_SOURCES = ("ranks_per_node", "LOCAL_WORLD_SIZE", "hostname")


def node_ids(group: dist.ProcessGroup, ranks_per_node: int | None, device: torch.device, timeout_s: float) -> list[int]:
    """The node of every rank of ``group`` (group rank order): ``ranks_per_node`` when given (emulated nodes),
    else torchrun's ``LOCAL_WORLD_SIZE`` (global ranks are node-contiguous under torchrun), else the hostnames.

    Collective over ``group``, waiting at most ``timeout_s``: every rank's source and value (and hostname) are
    exchanged first, so ranks that disagree (one given another ``ranks_per_node``, nodes started with different
    ``--nproc-per-node``) and a bad ``ranks_per_node`` on some ranks raise the same ValueError on every rank,
    before any subgroup is made."""
    num_ranks = dist.get_world_size(group)
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    source, value, error = (
        (0, ranks_per_node, None)
        if ranks_per_node is not None
        else (1, local_world, None)
        if local_world is not None
        else (2, 0, None)
    )
    if source == 0:
        try:  # the error travels to every rank in the exchange below, so it is kept, not raised here
            if num_ranks % positive_int(value, "ranks_per_node"):
                error = f"ranks_per_node: {value} does not divide the {num_ranks} EP ranks"
        except (TypeError, ValueError) as exc:
            error = str(exc)
    elif source == 1:
        value = int(value) if value.isdigit() and int(value) > 0 else value
        if not isinstance(value, int):
            error = f"$LOCAL_WORLD_SIZE: expected a positive int, got {value!r}"
    host = int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest(), "little")
    word = [source, value if error is None else -1, host]
    exchange = TorchTransport(group, device if dist.get_backend(group) == "nccl" else torch.device("cpu"), timeout_s)
    rows = exchange._start_count_exchange(
        torch.tensor(word, dtype=torch.int64, device=exchange.device), "node layout exchange"
    )[1]().tolist()
    differ = [r for r, row in enumerate(rows) if row[:2] != rows[0][:2]]
    if differ:
        shown = ", ".join(
            f"rank {r} " + ("hostnames" if src == 2 else f"{_LAYOUT_SOURCES[src]}={v if v >= 0 else 'invalid'}")
            for r, (src, v, _) in enumerate(rows)
        )
        raise ValueError(
            f"ranks_per_node: the ranks disagree on the node layout: rank(s) {differ} differ from rank 0 "
            f"({shown}); every rank raises before any subgroup is made"
        )
    if error is not None:
        raise ValueError(error)
    if source == 2:
        first: dict[int, int] = {}
        return [first.setdefault(h, len(first)) for _, _, h in rows]
    if source == 0:
        return [r // value for r in range(num_ranks)]
    return [g // value for g in dist.get_process_group_ranks(group)]


def ranks_per_node_of(nodes: list[int]) -> int:
    """P from per-rank node ids; raises unless every node holds the same number of node-contiguous ranks."""
    num_nodes = len(set(nodes))
    per_node = len(nodes) // num_nodes
    if len(nodes) % num_nodes or nodes != [r // per_node for r in range(len(nodes))]:
        raise ValueError(
            f"the EP group's ranks must fill their nodes evenly and in order (rank r on node r // P); got nodes {nodes}"
        )
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


def split_by_node(group: dist.ProcessGroup, nodes: list[int], timeout_s: float) -> NodeSplit:
    """Create the two subgroups from per-rank node ids (:func:`node_ids`, agreed). Every rank creates its node group,
    then its rail group, and only members synchronise: EP groups that are subgroups of a larger world
    (Megatron's) need no world-wide order, and node groups are disjoint, so the creation cannot deadlock."""
    per_node = ranks_per_node_of(nodes)
    rank, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    node, local = divmod(rank, per_node)
    node_ranks, rail_ranks = ranks[node * per_node : (node + 1) * per_node], ranks[local::per_node]
    timeout = timedelta(seconds=timeout_s)  # a member that never arrives is an error after timeout_s, not a hang
    node_group = dist.new_group(node_ranks, timeout=timeout, use_local_synchronization=True)
    rail_group = dist.new_group(rail_ranks, timeout=timeout, use_local_synchronization=True)
    return NodeSplit(per_node, len(ranks) // per_node, node, local, node_ranks, rail_ranks, node_group, rail_group)


@dataclass
class _Chunk:
    """One chunk of a dispatch: this rank's tokens ``[start, end)`` and the handles of the two stages that moved
    them (the rail stage's over those tokens, the node stage's over the rows the rail stage brought)."""

    start: int
    end: int
    rail_handle: DispatchHandle
    node_handle: DispatchHandle


@dataclass
class _HierState:
    """Replay data: the chunks in token order and the reorder between node-stage and flat row order.

    ``to_flat`` ``[N_recv]`` int64: for each flat row, its row among the node stage's rows of all chunks
    concatenated in chunk order; ``to_node`` its inverse."""

    chunks: list[_Chunk]
    to_flat: torch.Tensor
    to_node: torch.Tensor


class HierarchicalTransport(Transport):
    """Rail group (``torch``) between nodes, node group (``nvlink`` or ``torch``) inside; see the module doc.
    ``intra`` serves ``split.node_group``, ``rail`` serves ``split.rail_group``."""

    name = "hierarchical"
    checks_peers_each_call = True

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        timeout_s: float,
        split: NodeSplit,
        intra: Transport,
        rail: Transport,
    ) -> None:
        super().__init__(group, device, timeout_s)
        self.ranks_per_node, self.num_nodes = split.ranks_per_node, split.num_nodes
        self.node, self.local_rank = split.node, split.local_rank
        self.node_ranks, self.rail_ranks = split.node_ranks, split.rail_ranks
        self.intra, self.rail = intra, rail
        # The count exchange over the whole group (host tensors on gloo, device ones on NCCL).
        self.whole = TorchTransport(
            group, device if dist.get_backend(group) == "nccl" else torch.device("cpu"), timeout_s
        )

    def destroy(self) -> None:
        for stage in (self.intra, self.rail):
            release = getattr(stage, "destroy", None)
            if release is not None:
                release()

    def check_error(self) -> None:
        self._stage("node", self.node_ranks, self.intra.check_error)

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
            raise TimeoutError(
                f"moe_ep_plugin[hierarchical] rank {self.rank}/{self.num_ranks} (node {self.node}, "
                f"local {self.local_rank}): the {what} stage stalled waiting on global ranks {peers}: "
                f"{exc}"
            ) from exc

    def _exchange_counts(self, args: DispatchArgs) -> tuple[torch.Tensor, list[int]]:
        """All-gather over the whole group: each rank's per-rank counts, out-of-range id count, token count, call
        signature (hidden, dtype, top-k width, experts, FP8 flags, chunks) and refusal code (0) → (``[R, R]`` int64
        counts on the host, every rank's token count); raises the same error on every rank if any rank refused the
        call, passed bad ids or disagrees (so ranks that would run different numbers of chunk collectives never
        start them)."""
        x, topk = args.x, args.topk_idx
        signature = [
            x.shape[1],
            permute.DTYPE_CODES.get(x.dtype, -1),
            0 if topk is None else topk.shape[1],
            args.num_experts,
            int(args.wire_fp8),
            int(args.fp8_out),
            int(args.topk_weights is not None),
            args.config.hierarchical_chunks,
        ]
        invalid = (
            torch.zeros(1, dtype=torch.int64, device="cpu")
            if topk is None
            else count_invalid(topk, args.num_experts).cpu()
        )
        local = torch.cat(
            [
                args.num_tokens_per_rank.to(torch.int64).cpu(),
                invalid.to(torch.int64),
                torch.tensor([x.shape[0]] + signature + [0], dtype=torch.int64, device="cpu"),
            ]
        )
        gathered = self._gather_counts(local)
        r = self.num_ranks
        negative = (gathered[:, :r] < 0).any(1).tolist()
        if any(negative):
            raise negative_counts_error([i for i, b in enumerate(negative) if b])
        bad = gathered[:, r].tolist()
        if any(bad):
            raise invalid_ids_error([i for i, b in enumerate(bad) if b], args.num_experts)
        signatures = gathered[:, r + 2 : -1]
        if not bool((signatures == signatures[0]).all()):
            names = [
                "hidden",
                "dtype",
                "top-k width",
                "num_experts",
                "fp8_dispatch",
                "fp8_out",
                "topk_weights given",
                "Config.hierarchical_chunks",
            ]
            differ = [names[j] for j in range(len(names)) if not bool((signatures[:, j] == signatures[0, j]).all())]
            raise ValueError(
                f"dispatch: the EP ranks disagree on {differ} (per rank: "
                f"{signatures[:, [names.index(d) for d in differ]].tolist()}); every rank must pass the "
                "same hidden size, dtype, top-k width, number of experts, FP8 options and chunks"
            )
        return gathered[:, :r], gathered[:, r + 1].tolist()

    def _gather_counts(self, local: torch.Tensor, refusal: Exception | None = None) -> torch.Tensor:
        """All-gather ``local`` (``_COUNT_WORDS`` + R int64 words, the refusal code last) over the whole group →
        ``[R, C]`` on the host; raises the refusal on every rank alike when any rank refused the call."""
        read = self.whole._start_count_exchange(
            local.to(self.whole.device), "the dispatch count exchange over the whole EP group"
        )[1]
        gathered = self._stage("count exchange", dist.get_process_group_ranks(self.group), read).cpu()
        self.whole._check_refusals("dispatch", gathered[:, -1].tolist(), refusal)
        return gathered

    def refuse(self, call: str, exc: Exception) -> None:
        local = torch.zeros(self.num_ranks + _COUNT_WORDS, dtype=torch.int64, device="cpu")
        local[-1] = refusal_code(exc)
        self._gather_counts(local, refused(call, exc))

    def _sources(self, chunk: int, num_chunks: int, rail: DispatchResult, num_tokens: list[int]) -> torch.Tensor:
        """``[rows, 4]`` int32 for the rows the rail stage brought in ``chunk``: column 0 the source token (its
        index among all the source rank's tokens), column 1 the source's EP group rank, the rest 0 (the node stage
        forwards the rows as 16 bytes). ``num_tokens``: every EP rank's token count, for where its chunk starts."""
        handle = rail.handle
        rows = handle.num_recv_tokens
        prefix = handle.rank_prefix_matrix[:, self.node].to(torch.int64)  # rail rank = node index
        from_node = prefix - torch.cat([prefix.new_zeros(1), prefix[:-1]])
        node = torch.repeat_interleave(torch.arange(self.num_nodes, device=prefix.device), from_node, output_size=rows)
        rank = node * self.ranks_per_node + self.local_rank
        starts = torch.tensor(
            [
                _bounds(num_tokens[m * self.ranks_per_node + self.local_rank], num_chunks)[chunk]
                for m in range(self.num_nodes)
            ],
            dtype=torch.int64,
            device=prefix.device,
        )
        packed = torch.zeros(rows, 4, dtype=torch.int32, device=prefix.device)
        packed[:, 0] = handle.recv_src_idx.to(torch.int64) + starts.index_select(0, node)
        packed[:, 1] = rank
        return packed

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        if args.handle is None and args.topk_idx is None:
            return self._dispatch_without_topk(args)
        cached = args.handle is not None
        x, x_scales = args.x, args.x_scales
        if args.wire_fp8:
            x, x_scales = fp8.quantize(x, round_scale=args.round_scale)
        node_experts = args.num_experts // self.num_nodes
        if cached:
            chunks: list[_Chunk] = args.handle.transport_state.chunks
            bounds = [c.start for c in chunks] + [chunks[-1].end]
        else:
            counts, num_tokens = self._exchange_counts(args)
            bounds = _bounds(x.shape[0], args.config.hierarchical_chunks)
            in_node = self._in_node(args.is_token_in_rank)
        num_chunks = len(bounds) - 1

        def start_rail(i: int) -> Callable[[], DispatchResult]:
            """Issue the rail stage of chunk ``i``: its tokens once to every node hosting one of their experts."""
            a, b = bounds[i], bounds[i + 1]
            scales = None if x_scales is None else x_scales[a:b]
            if cached:
                rail_args = _cached_args(x[a:b], scales, chunks[i].rail_handle, args.config)
            else:
                weights = None if args.topk_weights is None else args.topk_weights[a:b]
                rail_args = DispatchArgs(
                    x=x[a:b],
                    x_scales=scales,
                    topk_idx=args.topk_idx[a:b],
                    topk_weights=weights,
                    num_tokens_per_rank=in_node[a:b].sum(0, dtype=torch.int32),
                    is_token_in_rank=in_node[a:b],
                    num_experts=args.num_experts,
                    handle=None,
                    num_worst_tokens=0,
                    wire_fp8=False,
                    fp8_out=False,
                    round_scale=False,
                    config=args.config,
                )
            finish = self._stage(_RAIL_DISPATCH, self.rail_ranks, self.rail.start_dispatch, rail_args)
            return lambda: self._stage(_RAIL_DISPATCH, self.rail_ranks, finish)

        def node_stage(i: int, rail: DispatchResult) -> tuple[DispatchResult, torch.Tensor | None]:
            """Forward chunk ``i``'s rail rows inside the node → (the node stage's result, and for an uncached
            dispatch each received row's source token and rank as :meth:`_sources` packs them)."""
            if cached:
                node_args = _cached_args(rail.recv_x, rail.recv_scales, chunks[i].node_handle, args.config)
                return self._stage(_NODE_DISPATCH, self.node_ranks, self.intra.dispatch, node_args), None
            per_rank, per_expert, in_rank = self.intra.get_dispatch_layout(rail.recv_topk_idx, node_experts)
            node_args = DispatchArgs(
                x=rail.recv_x,
                x_scales=rail.recv_scales,
                topk_idx=rail.recv_topk_idx,
                topk_weights=rail.recv_topk_weights,
                num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank,
                num_experts=node_experts,
                handle=None,
                num_worst_tokens=0,
                wire_fp8=False,
                fp8_out=False,
                round_scale=False,
                config=args.config,
                num_tokens_per_expert=per_expert,
            )
            node = self._stage(_NODE_DISPATCH, self.node_ranks, self.intra.dispatch, node_args)
            packed = self._sources(i, num_chunks, rail, num_tokens)
            fwd = self._stage(
                "intra-node (node group) source-index",
                self.node_ranks,
                self.intra.dispatch,
                _cached_args(packed.view(torch.bfloat16), None, node.handle, args.config),
            )
            return node, fwd.recv_x.view(torch.int32)[:, :2]

        # The pipeline: chunk i + 1's rail exchange is in flight while chunk i's node stage runs.
        rails, nodes, sources = [], [], []
        pending = start_rail(0)
        for i in range(num_chunks):
            rails.append(pending())
            if i + 1 < num_chunks:
                pending = start_rail(i + 1)
            node, src = node_stage(i, rails[i])
            nodes.append(node)
            sources.append(src)

        if cached:
            handle = args.handle
        else:
            src = _cat(sources)
            # Flat order: source rank, then source token; each (rank, token) pair arrives at most once.
            to_flat = torch.argsort((src[:, 1].to(torch.int64) << 32) + src[:, 0])
            to_node = torch.empty_like(to_flat)
            to_node[to_flat] = torch.arange(to_flat.shape[0], dtype=torch.int64, device=to_flat.device)
            in_rank = args.is_token_in_rank
            num_recv = to_flat.shape[0]
            handle = DispatchHandle(
                rank_prefix_matrix=counts.cumsum(0).to(torch.int32).to(self.device),
                is_token_in_rank=in_rank,
                send_pos=send_positions(in_rank),
                recv_src_idx=src[:, 0].index_select(0, to_flat).contiguous(),
                num_tokens=x.shape[0],
                num_recv_tokens=num_recv,
                num_experts=args.num_experts,
                rank=self.rank,
                num_ranks=self.num_ranks,
                num_recv_rows=max(num_recv, args.num_worst_tokens),
                topk_idx=args.topk_idx,
                transport_state=_HierState(
                    [_Chunk(bounds[i], bounds[i + 1], rails[i].handle, nodes[i].handle) for i in range(num_chunks)],
                    to_flat,
                    to_node,
                ),
            )
        state: _HierState = handle.transport_state
        num_recv, rows = handle.num_recv_tokens, handle.num_recv_rows
        if rows < num_recv:
            raise ValueError(
                f"num_worst_tokens={args.num_worst_tokens} is smaller than the {num_recv} rows rank "
                f"{self.rank} receives"
            )

        recv_x = _reordered(_cat([n.recv_x for n in nodes]), state.to_flat, rows, 0)
        recv_scales = None
        if nodes[0].recv_scales is not None:
            recv_scales = _reordered(_cat([n.recv_scales for n in nodes]), state.to_flat, rows, 0)
        if recv_scales is not None and args.wire_fp8 and not args.fp8_out:
            recv_x, recv_scales = fp8.dequantize(recv_x, recv_scales, args.x.dtype), None
        recv_idx = recv_w = expert_counts = host_counts = None
        if not cached:
            recv_idx = _reordered(_cat([n.recv_topk_idx for n in nodes]), state.to_flat, rows, -1)
            if nodes[0].recv_topk_weights is not None:
                recv_w = _reordered(_cat([n.recv_topk_weights for n in nodes]), state.to_flat, rows, 0)
            expert_counts = torch.stack([n.num_recv_tokens_per_expert for n in nodes]).sum(0, dtype=torch.int32)
            if all(n.host_counts is not None for n in nodes):
                host_counts = [sum(c) for c in zip(*(n.host_counts for n in nodes), strict=False)]
        return DispatchResult(recv_x, recv_scales, recv_idx, recv_w, expert_counts, handle, host_counts)

    def _dispatch_without_topk(self, args: DispatchArgs) -> DispatchResult:
        """DeepEP's dispatch without top-k (rows go where ``is_token_in_rank`` says): each token's ranks become
        top-k columns naming the first expert of each rank (-1 elsewhere), so both stages route it as any top-k
        dispatch, and the handle is that dispatch's. The outputs carry no top-k, and the per-expert list sums every
        rank's ``num_tokens_per_expert`` over this rank's experts, as the ``torch`` transport's does."""
        num_local = args.num_experts // self.num_ranks
        first = torch.arange(self.num_ranks, dtype=torch.int64, device=args.x.device) * num_local
        topk = torch.where(args.is_token_in_rank, first, -1)
        result = self.dispatch(dataclasses.replace(args, topk_idx=topk, layout_given=False))
        # every rank agreed on num_experts in the dispatch's count exchange: the [E] counts line up
        counts = self.whole._start_count_exchange(
            args.num_tokens_per_expert.to(torch.int64).to(self.whole.device), "the per-expert count exchange"
        )[1]()
        mine = counts[:, self.rank * num_local : (self.rank + 1) * num_local].sum(0)
        return DispatchResult(
            result.recv_x,
            result.recv_scales,
            None,
            None,
            mine.to(torch.int32).to(self.device),
            result.handle,
            mine.tolist(),
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        state: _HierState = handle.transport_state
        num_recv = handle.num_recv_tokens
        x_node = x[:num_recv].index_select(0, state.to_node)
        w_node = None if topk_weights is None else topk_weights[:num_recv].index_select(0, state.to_node)
        # The pipeline, the dispatch's reversed: chunk i's node reduction runs while chunk i - 1's partials are in
        # flight between nodes. Each token lies in one chunk, so its sums are the unchunked ones, bit for bit.
        pending, done, lo = None, [], 0
        for chunk in state.chunks:
            hi = lo + chunk.node_handle.num_recv_tokens
            # One partial per (token, node), rounded to x.dtype: the bytes that cross the network.
            partial, partial_w = self._stage(
                "intra-node (node group) combine",
                self.node_ranks,
                self.intra.combine,
                x_node[lo:hi],
                chunk.node_handle,
                None if w_node is None else w_node[lo:hi],
                (),
                config,
            )
            if pending is not None:
                done.append(self._stage(_RAIL_COMBINE, self.rail_ranks, pending))
            pending = self._stage(
                _RAIL_COMBINE,
                self.rail_ranks,
                self.rail.start_combine,
                partial,
                chunk.rail_handle,
                partial_w,
                tuple(b[chunk.start : chunk.end] for b in bias),
                config,
            )
            lo = hi
        done.append(self._stage(_RAIL_COMBINE, self.rail_ranks, pending))
        combined_w = None if topk_weights is None else _cat([w for _, w in done])
        return _cat([c for c, _ in done]), combined_w


_RAIL_DISPATCH = "inter-node (rail group) dispatch"
_NODE_DISPATCH = "intra-node (node group) dispatch"
_RAIL_COMBINE = "inter-node (rail group) combine"
_COUNT_WORDS = 11  # words of the count exchange beyond the R per-rank counts: ids, tokens, signature (8), refusal


def _cached_args(
    x: torch.Tensor, x_scales: torch.Tensor | None, handle: DispatchHandle, config: Config
) -> DispatchArgs:
    """A sub-stage replay of ``handle``'s layout: rows (and FP8 scales) only."""
    return DispatchArgs(
        x=x,
        x_scales=x_scales,
        topk_idx=None,
        topk_weights=None,
        num_tokens_per_rank=None,
        is_token_in_rank=None,
        num_experts=handle.num_experts,
        handle=handle,
        num_worst_tokens=0,
        wire_fp8=False,
        fp8_out=False,
        round_scale=False,
        config=config,
    )


def _bounds(num_tokens: int, num_chunks: int) -> list[int]:
    """The ``num_chunks + 1`` token offsets that split ``num_tokens`` tokens into contiguous chunks as evenly as
    possible (empty chunks when there are fewer tokens than chunks)."""
    return [i * num_tokens // num_chunks for i in range(num_chunks + 1)]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' rows in chunk order; one chunk is returned as it is (no copy on the unchunked path). FP8 rows
    are joined as bytes (not every device concatenates float8 types)."""
    if len(parts) == 1:
        return parts[0]
    if parts[0].dtype == fp8.FP8_DTYPE:
        return torch.cat([p.view(torch.uint8) for p in parts]).view(fp8.FP8_DTYPE)
    return torch.cat(parts)


def _reordered(t: torch.Tensor, to_flat: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """Node-stage rows ``t`` in flat order, extended to ``rows`` rows of ``fill`` (``num_worst_tokens``).
    FP8 rows move as bytes (not every device indexes float8 types)."""
    data = t.view(torch.uint8) if t.dtype == fp8.FP8_DTYPE else t
    out = data.new_full((rows,) + tuple(data.shape[1:]), fill)
    out[: to_flat.shape[0]] = data.index_select(0, to_flat)
    return out.view(t.dtype)
