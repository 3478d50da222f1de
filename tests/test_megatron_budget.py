"""``ep_plugin``'s dropless dispatch sized on the device from a row budget (``megatron/budget.py``): the six dispatcher
methods driven directly against a plain loop (1 rank on ``local``, 2 gloo ranks on ``torch``), the budget cut and
its report (``check_over_budget`` raising on every rank, or the drop accepted), and no host read: on ``local`` the
dispatcher's forward and backward run with every way a CPU tensor reaches a Python value patched to raise, and on
``nvlink`` (the host logic over the recording stand-in of the kernel library) no count is read back either.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.fake_kernels import STREAM, FakeLib, installed, nvlink_transport  # noqa: E402
from support.host_reads import no_host_reads  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.config import round_up  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402
from moe_ep_plugin.ops import layout  # noqa: E402

EXPERTS, TOPK, HIDDEN, TOKENS = 8, 3, 32, 6


def _routing(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``probs [T, E]`` (zero off the map) and ``routing_map [T, E]``: top-k of random scores, some pairs
    dropped (fewer than top-k experts for some tokens), expert 1 taken by every token (an expert over the mean)."""
    scores = torch.rand(tokens, EXPERTS, generator=gen)
    scores[:, 1] = 2.0
    routing_map = torch.zeros(tokens, EXPERTS, dtype=torch.bool).scatter_(1, scores.topk(TOPK, 1).indices, True)
    routing_map &= torch.rand(tokens, EXPERTS, generator=gen) > 0.2
    probs = torch.where(routing_map, torch.rand(tokens, EXPERTS, generator=gen) + 0.1, 0.0)
    return probs, routing_map


def _dispatcher(options, alignment: int = 1, captured: bool = False, tp: int = 1):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_ep_plugin.megatron import EPPluginTokenDispatcher

    ep = dist.get_world_size() // tp  # expert TP is the fastest dimension of the TP x EP group
    ep_rank, num_local = dist.get_rank() // tp, EXPERTS // ep
    layer = dict(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True, add_bias_linear=False
    )
    moe = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_token_dispatcher_type="ep_plugin")
    parallel = dict(tensor_model_parallel_size=tp, expert_tensor_parallel_size=tp, expert_model_parallel_size=ep)
    config = TransformerConfig(**layer, **moe, **parallel)
    if captured:  # Megatron's local graphs of the whole layer (set after __post_init__: no CUDA here)
        config.cuda_graph_impl = "local"
    pgc = get_default_pg_collection()
    dispatcher = EPPluginTokenDispatcher(
        num_local, list(range(ep_rank * num_local, (ep_rank + 1) * num_local)), config, pgc, options=options
    )
    dispatcher.alignment = alignment  # what moe_router_padding_for_quantization sets (FP8 needs TransformerEngine)
    return dispatcher


def _run(dispatcher, x, probs, routing_map, grad, reads_checked: bool = False):
    """The six methods with an expert that scales each row by its prob in fp32, then backward of ``grad``. →
    ``(rows, tokens_per_expert, row_probs, out, x.grad, probs.grad)``."""
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)

    def guard() -> contextlib.AbstractContextManager:
        return no_host_reads() if reads_checked else contextlib.nullcontext()

    with guard():
        h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
        h, p = dispatcher.token_dispatch(h, p)
        rows, tokens_per_expert, row_probs = dispatcher.dispatch_postprocess(h, p)
    expert_out = (rows.float() * row_probs.unsqueeze(-1)).to(rows.dtype)
    with guard():
        out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(expert_out)))
        out.backward(grad)
    return rows.detach(), tokens_per_expert, row_probs.detach(), out.detach(), x.grad, probs.grad


def _check(world_inputs, factor: float | None, alignment: int, transport: str) -> None:
    """The budgeted dispatcher (a CUDA graph holding the dispatch; the worst-case budget without ``factor``)
    against a plain loop over every rank's pairs: its rows, counts and probs; the output
    and both gradients bit for bit those of the counted dispatcher where every pair fits, else (pairs past the
    budget dropped) those of a plain loop over the kept pairs."""
    from moe_ep_plugin.megatron import PluginOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    num_local = EXPERTS // world
    drop = factor is not None
    budgeted = _dispatcher(
        PluginOptions(transport=transport, recv_capacity_factor=factor, drop_on_overflow=drop), alignment, True
    )
    assert budgeted.budgeted
    x, probs, routing_map = world_inputs[rank]
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + rank))
    rows, tokens_per_expert, row_probs, out, dx, dp = _run(budgeted, x, probs, routing_map, grad)

    # the expert-major layout as a plain loop: expert, then source rank, then token; blocks aligned; cut at P
    worst = world * TOKENS * min(TOPK, num_local) + num_local * (alignment - 1)
    budget = worst if factor is None else min(worst, round_up(math.ceil(factor * TOKENS * TOPK), alignment))
    kept: set[tuple[int, int, int]] = set()  # (source rank, token, expert) of every pair some rank's layout holds
    for owner in range(world):
        layout_rows, layout_probs, layout_counts = [], [], []
        for local in range(num_local):
            e = owner * num_local + local
            start = len(layout_rows)
            for src in range(world):
                src_x, src_probs, src_map = world_inputs[src]
                for t in range(TOKENS):
                    if src_map[t, e]:
                        if len(layout_rows) < budget:
                            kept.add((src, t, e))
                        layout_rows.append(src_x[t])
                        layout_probs.append(src_probs[t, e])
            layout_rows += [torch.zeros(HIDDEN)] * (-(len(layout_rows) - start) % alignment)
            layout_probs += [torch.zeros(())] * (len(layout_rows) - len(layout_probs))
            layout_counts.append(max(0, min(len(layout_rows), budget) - min(start, budget)))
        if owner == rank:
            expected_rows, expected_probs, counts = layout_rows, layout_probs, layout_counts
    counts[-1] += budget - sum(counts)  # the rows past the layout belong to the last expert's block
    expected_rows = (expected_rows + [torch.zeros(HIDDEN)] * budget)[:budget]
    expected_probs = (expected_probs + [torch.zeros(())] * budget)[:budget]
    assert rows.shape == (budget, HIDDEN) and torch.equal(rows, torch.stack(expected_rows))
    assert torch.equal(row_probs, torch.stack(expected_probs).float())
    assert tokens_per_expert.dtype == torch.int64 and tokens_per_expert.tolist() == counts

    if factor is None:  # every pair fits: the counted dispatcher's bits
        counted = _dispatcher(PluginOptions(transport=transport), alignment)
        _, _, _, out_c, dx_c, dp_c = _run(counted, x, probs, routing_map, grad)
        assert torch.equal(out, out_c) and torch.equal(dx, dx_c) and torch.equal(dp, dp_c)
        budgeted.check_over_budget()
        return
    # pairs past the budget were dropped: the plain loop over the kept pairs (fp32 sums of fp32 products)
    expected_out = torch.zeros(TOKENS, HIDDEN)
    expected_dp = torch.zeros(TOKENS, EXPERTS)
    for t in range(TOKENS):
        for e in range(EXPERTS):
            if (rank, t, e) in kept:
                expected_out[t] += x[t] * probs[t, e]
                expected_dp[t, e] = (x[t] * grad[t]).sum()
    torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-6)
    gates = torch.tensor([[float((rank, t, e) in kept) for e in range(EXPERTS)] for t in range(TOKENS)])
    torch.testing.assert_close(dx, grad * (probs * gates).sum(1, keepdim=True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dp, expected_dp, rtol=1e-5, atol=1e-5)
    budgeted.check_over_budget()  # the drop was asked for: no error


def _overflow_raises(world_inputs, transport: str) -> None:
    """Without ``drop_on_overflow`` the pairs past the budget make ``check_over_budget`` (the model-wide form the
    launcher calls) raise on every rank, once: the count resets."""
    from moe_ep_plugin.megatron import PluginOptions, check_over_budget

    x, probs, routing_map = world_inputs[dist.get_rank()]
    dispatcher = _dispatcher(PluginOptions(transport=transport, recv_capacity_factor=0.25))
    _run(dispatcher, x, probs, routing_map, torch.ones(x.shape))
    model = torch.nn.Module()
    model.token_dispatcher = dispatcher  # what the launcher's check after each step finds in a MoE layer
    with pytest.raises(ValueError, match="raise ep_plugin.recv_capacity_factor.*drop_on_overflow"):
        check_over_budget(model)
    dispatcher.check_over_budget()


def _suite(seed: int, transport: str) -> None:
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    gens = [torch.Generator().manual_seed(seed * 10 + r) for r in range(world)]
    world_inputs = [(torch.randn(TOKENS, HIDDEN, generator=g), *_routing(TOKENS, g)) for g in gens]
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    try:
        for factor, alignment in ((None, 1), (None, 4), (0.5, 1), (0.5, 4)):
            _check(world_inputs, factor, alignment, transport)
        _overflow_raises(world_inputs, transport)
        if world == 1:  # local: nothing is read on the host, forward or backward
            from moe_ep_plugin.megatron import PluginOptions

            x, probs, routing_map = world_inputs[0]
            for factor in (None, 0.5):
                dispatcher = _dispatcher(PluginOptions(transport="local", recv_capacity_factor=factor), 4, True)
                _run(dispatcher, x, probs, routing_map, torch.ones(x.shape), reads_checked=True)
    finally:
        ps.destroy_model_parallel()
    if world == 2:
        _expert_tp(world_inputs[dist.get_rank()], transport)


def _expert_tp(inputs: tuple[torch.Tensor, ...], transport: str) -> None:
    """Expert TP 2 x EP 1 (the routing map replicated over TP, each TP rank's partial outputs summed): the budgeted
    dispatcher's output and gradients equal the counted one's bit for bit."""
    from megatron.core import parallel_state as ps

    from moe_ep_plugin.megatron import PluginOptions

    x, probs, routing_map = inputs
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=2)
    try:
        budgeted = _dispatcher(PluginOptions(transport=transport), 4, True, tp=2)
        counted = _dispatcher(PluginOptions(transport=transport), 4, tp=2)
        assert budgeted.budgeted and not counted.budgeted
        got = _run(budgeted, x, probs, routing_map, grad)[3:]
        want = _run(counted, x, probs, routing_map, grad)[3:]
        for name, a, b in zip(("output", "x grad", "probs grad"), got, want, strict=True):
            assert torch.equal(a, b), f"expert TP: budgeted {name} differs from the counted dispatcher's"
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize(("world", "transport"), [(1, "local"), (2, "torch")])
def test_budgeted_dispatcher_matches_plain_loop(world: int, transport: str) -> None:
    spawn(_suite, world, args=(int(time.time()) % 1000, transport), backend="gloo", timeout_s=120)


def test_no_host_read_guard_catches_a_read() -> None:
    """The guard the tests above rely on fires on a count read."""
    with no_host_reads(), pytest.raises(AssertionError, match="Tensor.tolist"):
        torch.ones(2).tolist()
    with no_host_reads(), pytest.raises(AssertionError, match="Tensor.__bool__"):
        bool(torch.ones(1))


class _SlotLib(FakeLib):
    """The recording stand-in, with ``moe_ep_expert_slots`` writing what the host indexes with: every slot -1 (no
    local expert) and zero counts."""

    def moe_ep_expert_slots(self, idx, n, k, num_local, alignment, slot, words, workspace, blocks, stream) -> int:
        self._record("moe_ep_expert_slots", (idx, n, k, num_local, alignment, slot, words, workspace, blocks, stream))
        ctypes.memset(slot, 0xFF, 4 * n * k)
        ctypes.memset(words, 0, 8 * (2 + num_local))
        return 0


def _nvlink_buffer(lib: FakeLib, rank: int, num_ranks: int) -> Buffer:
    """A Buffer of rank ``rank`` of ``num_ranks`` whose transport is the nvlink host logic over ``lib``."""
    buffer = Buffer.__new__(Buffer)
    buffer.group, buffer.rank, buffer.group_size = None, rank, num_ranks
    buffer.device, buffer._cuda, buffer.transport_name = torch.device("cpu"), False, "nvlink"
    buffer.transport = nvlink_transport(lib, rank, num_ranks, 0)
    buffer.timeout_s, buffer._comm_stream, buffer._last_stream = 5.0, None, None
    buffer.destroyed, buffer._low_latency, buffer.low_latency_mode = False, None, False
    return buffer


def test_nvlink_budgeted_dispatch_reads_nothing() -> None:
    """On ``nvlink`` the budgeted dispatch and combine, forward and backward, read no count back (no host read of
    the kernel library, no tensor turned into a Python value) and hand the kernels fixed row counts."""
    from moe_ep_plugin.megatron import budget

    world = 2
    with (
        installed(_SlotLib(world)) as lib,
        mock.patch.object(layout, "current_stream_handle", lambda index: STREAM),
        mock.patch.object(layout.library, "load", lambda: lib),
        mock.patch.object(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=4)),
    ):
        buffer = _nvlink_buffer(lib, 1, world)
        probs, routing_map = _routing(TOKENS, torch.Generator().manual_seed(3))
        x = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16).requires_grad_(True)
        probs.requires_grad_(True)
        rows = budget.row_budget(TOKENS, world, TOPK, EXPERTS // world, 4, 0.5)
        with no_host_reads():
            expert_x, expert_probs, tokens_per_expert, handle, excess = budget.dispatch(
                buffer, rows, x, routing_map, probs, TOPK, EXPERTS, alignment=4
            )
            out = budget.combine(buffer, (expert_x.float() * expert_probs.unsqueeze(1)).to(x.dtype), handle)
            out.float().sum().backward()
        names = [name for name, _ in lib.calls]
        assert "moe_ep_read_start" not in names and "moe_ep_read_wait" not in names
        dispatches = [args[1] for name, args in lib.calls if name == "moe_ep_dispatch"]
        # forward dispatch, backward's cached dispatch: both into W = 2 x 6 rows
        assert [d["num_recv_rows"] for d in dispatches] == [world * TOKENS] * 2
        assert expert_x.shape == (rows.rows, HIDDEN) and tokens_per_expert.shape == (EXPERTS // world,)
        assert excess.shape == () and x.grad.shape == x.shape and probs.grad.shape == probs.shape
