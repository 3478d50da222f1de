"""One shared Buffer behind many ``ElasticBuffer``s (DeepSpeed AutoEP before its PR #8557 made one per MoE layer).

On 2 gloo ranks (torch transport): 48 ``ElasticBuffer``s of one group lease one Buffer (one made, one transport);
each layer dispatches (expanded, weights carried, as AutoEP does) and, after every other layer dispatched,
combines in reverse order, equal to the plain loop ``out[t] = Σ_k w[t, k] · (idx[t, k] + 1) · x[t]`` (dyadic values:
exact). Destroying them in a shuffled order keeps the Buffer for the rest (the last one still works, a destroyed
one raises), the last destroy destroys it, and the next buffer gets a fresh one. A larger ``num_bytes`` leases a
larger Buffer that later buffers share; ranks asking for different sizes raise alike on every rank. DeepSpeed
0.19.8's ``shared_exchange`` with a new scope per layer (its per-layer use) gets 48 exchanges on one Buffer, and
``destroy_exchanges`` releases it.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.distributed as dist

from moe_ep_plugin.launch import spawn

HIDDEN, TOPK, LOCAL, TOKENS, LAYERS = 16, 2, 2, 6, 48


def _inputs(layer: int, rank: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s tokens on ``rank``: small-integer ``x`` (fp32), distinct top-k ids (some -1), weights in
    quarters, so every sum below is exact."""
    gen = torch.Generator().manual_seed(1000 * layer + rank)
    x = torch.randint(-4, 5, (TOKENS, HIDDEN), generator=gen).float()
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:TOPK] for _ in range(TOKENS)])
    idx[torch.rand(TOKENS, TOPK, generator=gen) < 0.2] = -1
    w = (torch.randint(1, 5, (TOKENS, TOPK), generator=gen).float() / 4).masked_fill(idx < 0, 0.0)
    return x, idx, w


def _plain_loop(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] += float(w[t, k]) * (e + 1) * x[t]
    return out


def _experts(buffer, rows: torch.Tensor, weights: torch.Tensor, handle) -> torch.Tensor:
    """Expert ``e`` multiplies its rows by ``e + 1``; the routing weight applied after, as AutoEP does."""
    arrived = handle.num_expanded_tokens
    prefix = handle.psum_num_recv_tokens_per_expert
    counts = torch.diff(prefix, prepend=prefix.new_zeros(1)).tolist()
    first = buffer.rank_idx * LOCAL
    outs = [block * (first + e + 1) for e, block in enumerate(rows[:arrived].split(counts))]
    out = torch.zeros_like(rows)
    out[:arrived] = torch.cat(outs) * weights[:arrived].reshape(-1, 1)
    return out


def _round_trip(buffers: list, num_experts: int) -> None:
    """Every buffer dispatches, then every buffer combines in reverse order (a forward, then a backward)."""
    rank = dist.get_rank()
    pending = []
    for layer, buffer in enumerate(buffers):
        x, idx, w = _inputs(layer, rank, num_experts)
        rows, _, recv_w, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=num_experts, do_expand=True, expert_alignment=1
        )
        pending.append((layer, buffer, x, idx, w, _experts(buffer, rows, recv_w, handle), handle))
    for layer, buffer, x, idx, w, rows, handle in reversed(pending):
        combined = buffer.combine(rows, handle)[0]
        assert torch.equal(combined, _plain_loop(x, idx, w)), f"layer {layer}"


def _suite() -> None:
    from moe_ep_plugin import buffer_cache, deep_ep

    made = []

    class Counted(buffer_cache.Buffer):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    buffer_cache.Buffer = Counted
    group, num_experts = dist.group.WORLD, LOCAL * dist.get_world_size()
    kw = dict(num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK, explicitly_destroy=True)
    layers = [deep_ep.ElasticBuffer(group, transport="torch", **kw) for _ in range(LAYERS - 1)]
    layers.append(deep_ep.EPBuffer(group, transport="torch", **kw))
    assert len(made) == 1
    shared = made[0]
    assert all(b.buffer is shared and b.buffer.transport is shared.transport for b in layers)
    _round_trip(layers, num_experts)

    order = list(range(LAYERS))
    random.Random(7).shuffle(order)  # the same order on every rank: destroy is collective at the last one
    for layer in order[:-1]:
        layers[layer].destroy()
        layers[layer].destroy()  # again: nothing
    assert not shared.destroyed
    x, idx, _ = _inputs(0, dist.get_rank(), num_experts)
    with pytest.raises(RuntimeError, match="used after destroy"):
        layers[order[0]].dispatch(x, topk_idx=idx, num_experts=num_experts)
    last = layers[order[-1]]
    _round_trip([last], num_experts)
    last.destroy()
    assert shared.destroyed
    fresh = deep_ep.ElasticBuffer(group, transport="torch", **kw)
    assert fresh.buffer is made[-1] is not shared and len(made) == 2

    # a larger num_bytes: a larger shared Buffer for later buffers; the earlier holder keeps its own
    big = deep_ep.ElasticBuffer(group, num_bytes=2 * fresh.num_bytes, transport="torch", **kw)
    later = deep_ep.ElasticBuffer(group, transport="torch", **kw)
    assert big.buffer is later.buffer is made[-1] is not fresh.buffer and len(made) == 3
    _round_trip([fresh, big, later], num_experts)
    with pytest.raises(ValueError, match="the ranks ask for different shared buffers"):
        deep_ep.ElasticBuffer(group, num_bytes=(dist.get_rank() + 1) << 21, transport="torch", **kw)
    for buffer in (fresh, big, later):
        buffer.destroy()
    assert all(b.destroyed for b in made)


def test_48_elastic_buffers_share_one_buffer() -> None:
    spawn(_suite, 2, backend="gloo")


def _deepspeed_per_layer() -> None:
    import moe_ep_plugin

    moe_ep_plugin.install_deep_ep()
    from deepspeed.module_inject import auto_ep_comm

    num_experts = LOCAL * dist.get_world_size()
    geometry = dict(num_experts=num_experts, top_k=TOPK, hidden_size=HIDDEN, num_max_tokens_per_rank=TOKENS)
    holders = []
    for _ in range(LAYERS):
        layer = torch.nn.Module()
        scope = auto_ep_comm.new_exchange_scope()  # a scope per layer: DeepSpeed's buffer per layer before #8557
        layer._deepep_exchange = auto_ep_comm.shared_exchange(scope=scope, ep_group=dist.group.WORLD, **geometry)
        holders.append(layer)
    exchanges = [layer._deepep_exchange for layer in holders]
    assert len({id(e) for e in exchanges}) == LAYERS  # one ElasticBuffer per layer, as DeepSpeed asked
    shared = exchanges[0].buffer.buffer
    assert all(e.buffer.buffer is shared for e in exchanges)  # ... and one Buffer behind them
    _round_trip([e.buffer for e in exchanges], num_experts)
    model = torch.nn.Sequential(*holders)
    auto_ep_comm.destroy_exchanges(model)
    assert shared.destroyed and all(e.destroyed for e in exchanges)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_exchange_per_layer_shares_one_buffer() -> None:
    spawn(_deepspeed_per_layer, 2, backend="gloo")
