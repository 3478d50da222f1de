"""Random ``ElasticBuffer`` rounds for ``benchmarks/soak.py --api elastic``: a fresh dispatch and a cached replay
of its handle with new rows and new weights, in a stream mode of DeepEP's ``tests/elastic/test_ep.py``, the
current stream kept busy on some rounds so that work the call does not wait for runs late.

Checked each round, on every rank without communication:
- the cached replay's rows and weights equal a fresh dispatch of the same rows and weights, bit for bit;
- combine of the received rows is a plain loop over tokens: rows are snapped to a grid of quarters, so
  ``combined[t] = x[t] * n(t)`` is exact in BF16, with ``n(t)`` the ranks token ``t`` went to (not expanded) or
  its valid top-k entries (expanded).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# SMs of every call: few, so that soaks and test runs side by side stay within the SMs of a GPU their ranks share
# (a rank whose blocks get no SM never arrives), and each SM's loop runs over many rows
NUM_SMS = 8
MODES = tuple((prev, async_, on_comm) for prev in (0, 1) for async_ in (0, 1) for on_comm in (0, 1))


@dataclass
class Round:
    """One round's draw (the same on every rank)."""

    seed: int
    do_expand: bool
    cpu_sync: bool
    mode: tuple[int, int, int]
    busy: bool
    tokens: int
    hidden: int
    topk: int
    experts_per_rank: int
    alignment: int

    def describe(self) -> str:
        prev, async_, on_comm = self.mode
        return (
            f"seed={self.seed} do_expand={self.do_expand} do_cpu_sync={self.cpu_sync} previous_event={prev} "
            f"async={async_} allocate_on_comm_stream={on_comm} busy={self.busy} tokens={self.tokens} "
            f"hidden={self.hidden} topk={self.topk} experts/rank={self.experts_per_rank}"
        )


def draw(seed: int, max_tokens: int) -> Round:
    """The round of ``seed`` (rank-independent; each rank's token count is drawn from it and its rank)."""
    r = random.Random(seed)
    return Round(
        seed=seed,
        do_expand=r.random() < 0.5,
        cpu_sync=r.random() < 0.5,
        mode=r.choice(MODES),
        busy=r.random() < 0.5,
        tokens=r.randint(0, max_tokens),
        hidden=r.choice((256, 512, 1024)),
        topk=r.randint(1, 8),
        experts_per_rank=r.choice((1, 2, 4, 8)),
        alignment=r.choice((1, 4, 128)),
    )


def _inputs(rnd: Round, rank: int, world: int, device: torch.device):
    gen = torch.Generator().manual_seed(rnd.seed * 131 + rank)
    tokens = rnd.tokens if rank == 0 else torch.randint(0, rnd.tokens + 1, (1,), generator=gen).item()
    experts = rnd.experts_per_rank * world
    topk = min(rnd.topk, experts)
    idx = (
        torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
        if tokens
        else torch.zeros(0, topk, dtype=torch.int64)
    )
    idx[torch.rand(tokens, topk, generator=gen) < 0.15] = -1

    def rows() -> torch.Tensor:
        return ((torch.randn(tokens, rnd.hidden, generator=gen) * 4).round().clamp(-16, 16) / 4).to(torch.bfloat16)

    def weights() -> torch.Tensor:
        return torch.rand(tokens, topk, generator=gen) + 0.5

    return (idx.to(device), rows().to(device), weights().to(device), rows().to(device), weights().to(device), experts)


def _call(buf, rnd: Round, **kw) -> tuple:
    prev, async_, on_comm = rnd.mode
    previous = buf.capture() if prev else None
    if rnd.busy and buf.buffer.device.type == "cuda":
        torch.cuda._sleep(2_000_000)  # the current stream busy while the call is issued
    out = buf.dispatch(
        num_sms=NUM_SMS,
        previous_event=previous,
        async_with_compute_stream=bool(async_),
        allocate_on_comm_stream=bool(on_comm),
        **kw,
    )
    if async_:
        out[-1].current_stream_wait()
    return out


def run(buf, rnd: Round, rank: int, world: int) -> list[str]:
    """Run ``rnd`` on the ``ElasticBuffer`` ``buf``; returns what mismatched (empty: all exact)."""
    idx, x, w, x2, w2, experts = _inputs(rnd, rank, world, buf.buffer.device)
    common = dict(
        num_experts=experts, do_expand=rnd.do_expand, expert_alignment=rnd.alignment, do_cpu_sync=rnd.cpu_sync
    )
    _, _, _, handle, _ = _call(buf, rnd, x=x, topk_idx=idx, topk_weights=w, **common)
    cached_x, _, cached_w, _, _ = _call(buf, rnd, x=x2, handle=handle, topk_weights=w2, do_expand=rnd.do_expand)
    fresh_x, _, fresh_w, fresh_handle, _ = _call(buf, rnd, x=x2, topk_idx=idx, topk_weights=w2, **common)
    errors = []
    if not torch.equal(cached_x, fresh_x):
        errors.append("cached rows differ from a fresh dispatch's")
    if not torch.equal(cached_w, fresh_w):
        errors.append("cached weights differ from a fresh dispatch's")
    combined, _, event = buf.combine(fresh_x, fresh_handle, num_sms=NUM_SMS)
    event.current_stream_wait()
    local = experts // world
    valid = idx >= 0
    if rnd.do_expand:
        copies = valid.sum(1)
    else:
        ranks = torch.where(valid, idx // local, -1)
        copies = (
            torch.stack([(ranks == r).any(1) for r in range(world)], 1).sum(1)
            if idx.shape[0]
            else torch.zeros(0, dtype=torch.int64, device=idx.device)
        )
    want = (x2.float() * copies[:, None]).to(torch.bfloat16)
    if not torch.equal(combined, want):
        errors.append(f"combine differs from the plain loop in {int((combined != want).any(1).sum())} tokens")
    if buf.buffer.device.type == "cuda":
        torch.cuda.synchronize(buf.buffer.device)
    return errors
