"""Random dispatch/combine rounds checked against a plain loop over tokens: the engine of ``benchmarks/soak.py``
and of ``tests/gpu/test_dropin_matrix.py``.

A round is drawn from one seed alike on every rank, and every rank builds every rank's inputs from it (no gather),
so the reference needs no communication. Combine inputs are each received row snapped to a grid of quarters in
[-4, 4] (``_grid``): any sum of up to 32 of them is exact in BF16, so combine is checked bit for bit whatever
order a transport sums in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from moe_ep_plugin import Buffer
from moe_ep_plugin.ops import fp8

from .reference import routing
from .settle import settle

MODES = ("sync", "async", "previous_event", "previous_event+async", "allocate_on_comm_stream")
FORMS = ("bf16", "fp32", "fp8 tuple", "fp8 in send path", "fp8 in send path, fp8 out")
ENTRIES = (
    "dispatch",
    "dispatch with layout",
    "dispatch without top-k",
    "cached dispatch",
    "num_worst_tokens",
    "dispatch_experts",
    "cached dispatch_experts",
)
ROUTINGS = ("random", "sparse", "one_expert")


@dataclass
class Round:
    """One round's draw (the same on every rank)."""

    seed: int
    entry: str
    mode: str
    form: str
    hidden: int
    topk: int
    experts_per_rank: int
    tokens: list[int]
    routing: str
    alignment: int

    def describe(self) -> str:
        return (
            f"seed={self.seed} entry={self.entry!r} mode={self.mode!r} form={self.form!r} hidden={self.hidden} "
            f"topk={self.topk} experts/rank={self.experts_per_rank} tokens={self.tokens} routing={self.routing}"
        )


@dataclass
class State:
    """What later rounds reuse: the last round's handles (row-major and expert-major) and the draw they came from."""

    handle: object | None = None
    handle_round: Round | None = None
    expert_handle: object | None = None
    expert_round: Round | None = None
    extra: dict = field(default_factory=dict)


def draw(
    seed: int,
    world: int,
    entry: str | None = None,
    mode: str | None = None,
    form: str | None = None,
    topk: int | None = None,
) -> Round:
    """A random round (``entry``/``mode``/``form``/``topk`` fixed when given)."""
    rng = random.Random(seed)
    form = form or rng.choice(FORMS)
    fp8_form = form.startswith("fp8")
    hidden = rng.choice((128, 256, 384, 1024) if fp8_form else (64, 128, 200, 256, 512))
    tokens = [rng.choice((0, rng.randint(1, 8), rng.randint(1, 64), rng.randint(64, 300))) for _ in range(world)]
    return Round(
        seed,
        entry or rng.choice(ENTRIES),
        mode or rng.choice(MODES),
        form,
        hidden,
        topk or rng.randint(1, 8),
        rng.choice((1, 2, 4, 8)),
        tokens,
        rng.choice(ROUTINGS),
        rng.choice((1, 1, 4, 16)),
    )


def _inputs(rnd: Round, src: int, world: int, device: torch.device):
    """Rank ``src``'s ``(x or (q, scales), topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert)`` (CPU
    and on ``device``); the last two are the random layout of a dispatch without top-k."""
    gen = torch.Generator().manual_seed(rnd.seed * 1009 + src)
    n, num_experts = rnd.tokens[src], rnd.experts_per_rank * world
    x = torch.randn(n, rnd.hidden, generator=gen)
    x = x.float() if rnd.form == "fp32" else x.bfloat16()
    if rnd.form == "fp8 tuple":
        x = fp8.quantize(x)
    idx = routing(rnd.routing, n, rnd.topk, num_experts, gen)
    w = torch.rand(n, rnd.topk, generator=gen)
    in_rank = torch.rand(n, world, generator=gen) < 0.6
    per_expert = torch.randint(0, 9, (num_experts,), generator=gen, dtype=torch.int32)
    return x, idx, w, in_rank, per_expert


def _to(v, device: torch.device):
    return tuple(_to(t, device) for t in v) if isinstance(v, tuple) else v.to(device)


def _received_form(rnd: Round, x):
    """A row as the receiver gets it: FP8 rows as ``(q, scales)``, rows quantized in the send path dequantized."""
    if rnd.form == "fp8 in send path":
        return fp8.dequantize(*fp8.quantize(x), x.dtype)
    if rnd.form == "fp8 in send path, fp8 out":
        return fp8.quantize(x)
    return x


def _grid(v: torch.Tensor) -> torch.Tensor:
    return (v.float() * 4).round().clamp(-16, 16) / 4


def _mode(buffer: Buffer, mode: str) -> dict:
    kw: dict = {}
    if "previous_event" in mode or mode == "allocate_on_comm_stream":
        kw["previous_event"] = buffer.capture()
    if "async" in mode:
        kw["async_finish"] = True
    if mode == "allocate_on_comm_stream":
        kw["allocate_on_comm_stream"] = True
    return kw


def _wait(result: tuple) -> tuple:
    result[-1].current_stream_wait()
    return result


def _same(got, want) -> bool:
    if isinstance(want, tuple):
        return isinstance(got, tuple) and all(_same(g, w) for g, w in zip(got, want, strict=False))
    got = got.cpu()
    if want.dtype == fp8.FP8_DTYPE:
        return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def run(buffer: Buffer, rnd: Round, state: State, rank: int, world: int) -> list[str]:
    """Run ``rnd`` on ``buffer`` and check every returned value; returns what mismatched (empty: all exact). Raises
    a wait of the round that timed out: its outputs were never written, which is that timeout, not a mismatch."""
    errors = _run(buffer, rnd, state, rank, world)
    settle(buffer)
    return errors


def _run(buffer: Buffer, rnd: Round, state: State, rank: int, world: int) -> list[str]:
    device = buffer.device
    if rnd.entry == "cached dispatch" and state.handle_round is None:
        rnd.entry = "dispatch"
    if rnd.entry == "cached dispatch_experts" and state.expert_round is None:
        rnd.entry = "dispatch_experts"
    cached = rnd.entry.startswith("cached")
    layout_round = (
        state.handle_round
        if rnd.entry == "cached dispatch"
        else state.expert_round
        if rnd.entry == "cached dispatch_experts"
        else rnd
    )
    if cached:  # the routing of the round the handle came from, new rows
        rnd.tokens, rnd.topk, rnd.experts_per_rank, rnd.routing = (
            layout_round.tokens,
            layout_round.topk,
            layout_round.experts_per_rank,
            layout_round.routing,
        )
    everyone = [_inputs(rnd, src, world, device) for src in range(world)]
    if cached:  # the layout's routing (drawn from the earlier round's seed)
        for src in range(world):
            old = _inputs(layout_round, src, world, device)
            everyone[src] = (everyone[src][0],) + old[1:]
    x, idx, w, in_rank_random, per_expert = everyone[rank]
    num_experts, local = rnd.experts_per_rank * world, rnd.experts_per_rank
    no_topk = rnd.entry == "dispatch without top-k" or (
        rnd.entry == "cached dispatch" and layout_round.entry == "dispatch without top-k"
    )
    fp8_send = rnd.form.startswith("fp8 in send path")
    opts = dict(fp8_dispatch=fp8_send, fp8_out=rnd.form.endswith("fp8 out"))
    mode = _mode(buffer, rnd.mode)
    errors: list[str] = []

    def check(what: str, ok: bool) -> None:
        if not ok:
            errors.append(what)

    # host copies read once per round (the loops below index them per token)
    idx_lists = [e[1].tolist() for e in everyone]
    in_rank_lists = [e[3].tolist() for e in everyone]

    def sent_to(src: int, t: int, d: int) -> bool:
        if no_topk:
            return in_rank_lists[src][t][d]
        return any(e >= 0 and e // local == d for e in idx_lists[src][t])

    rows = [(src, t) for src in range(world) for t in range(rnd.tokens[src]) if sent_to(src, t, rank)]
    # every source's rows as a receiver gets them (quantization is per row, so row t of the whole is row t alone)
    received = [e[0] if isinstance(e[0], tuple) else _received_form(rnd, e[0]) for e in everyone]

    def expected_row(src: int, t: int):
        r_ = received[src]
        return (r_[0][t : t + 1], r_[1][t : t + 1]) if isinstance(r_, tuple) else r_[t : t + 1]

    def stacked(parts: list):
        if not parts:
            return None
        if isinstance(parts[0], tuple):
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return torch.cat(parts)

    xd = _to(x, device)
    if rnd.entry in ("dispatch_experts", "cached dispatch_experts"):
        if cached:
            out = _wait(buffer.dispatch_experts(xd, handle=state.expert_handle, **opts, **mode))
        else:
            out = _wait(
                buffer.dispatch_experts(
                    xd, idx.to(device), w.to(device), num_experts, expert_alignment=rnd.alignment, **opts, **mode
                )
            )
            state.expert_handle, state.expert_round = out[4], rnd
        expert_x, expert_scales, probs, tokens_per_expert, handle = out[:5]
        alignment = handle.expert_layout.alignment
        blocks, block_w, counts = [], [], []
        for le in range(local):
            pairs = [(src, t, k) for src, t in rows for k, e in enumerate(idx_lists[src][t]) if e == rank * local + le]
            counts.append(len(pairs))
            blocks += [expected_row(src, t) for src, t, _ in pairs]
            block_w += [float(everyone[src][2][t, k]) for src, t, k in pairs]
            pad = -len(pairs) % alignment
            if pad:
                blocks.append(_zeros_like_row(expected_row(*rows[0]) if rows else None, rnd, pad))
                block_w += [0.0] * pad
        check("tokens_per_expert", tokens_per_expert == [(c + alignment - 1) // alignment * alignment for c in counts])
        want = stacked(blocks)
        got = expert_x if expert_scales is None else (expert_x, expert_scales)
        if want is not None:
            check("expert_x", _same(got, want))
        if not cached:
            check("expert_probs", probs is not None and probs.cpu().tolist() == block_w)
        y = _grid(expert_x if expert_scales is None else fp8.dequantize(expert_x, expert_scales)).to(_ydtype(rnd))
        ew = torch.rand(y.shape[0], generator=torch.Generator().manual_seed(rnd.seed)).to(device)
        combined, combined_w, _ = _wait(buffer.combine_experts(y, handle, ew, **_mode(buffer, rnd.mode)))
        snapped = _grid(plain_rows(rnd, everyone[rank][0]))
        ref = (
            torch.stack([snapped[t] * sum(1 for e in idx_lists[rank][t] if e >= 0) for t in range(x_rows(x))])
            if x_rows(x)
            else None
        )
        if ref is not None:
            check("combine_experts", torch.equal(combined.cpu().float(), ref))
        check("combine_experts weights shape", combined_w is not None and tuple(combined_w.shape) == tuple(idx.shape))
        return errors

    kw: dict = dict(**opts, **mode)
    if rnd.entry == "cached dispatch":
        out = _wait(buffer.dispatch(xd, handle=state.handle, **kw))
    elif no_topk:
        counts_r = in_rank_random.sum(0, dtype=torch.int32)
        out = _wait(
            buffer.dispatch(
                xd,
                num_tokens_per_rank=counts_r.to(device),
                is_token_in_rank=in_rank_random.to(device),
                num_tokens_per_expert=per_expert.to(device),
                expert_alignment=rnd.alignment,
                **kw,
            )
        )
    elif rnd.entry == "dispatch with layout":
        per_rank, _, per_exp, in_rank, _ = _wait(buffer.get_dispatch_layout(idx.to(device), num_experts, **mode))
        check("layout", per_exp.cpu().tolist() == [int((idx == e).sum()) for e in range(num_experts)])
        out = _wait(
            buffer.dispatch(
                xd,
                num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_exp,
                topk_idx=idx.to(device),
                topk_weights=w.to(device),
                expert_alignment=rnd.alignment,
                **opts,
                **_mode(buffer, rnd.mode),
            )
        )
    else:
        worst = 0
        if rnd.entry == "num_worst_tokens":
            most = max(
                sum(1 for src in range(world) for t in range(rnd.tokens[src]) if sent_to(src, t, d))
                for d in range(world)
            )
            worst = most + rnd.seed % 5 + 1
        out = _wait(
            buffer.dispatch(
                xd,
                topk_idx=idx.to(device),
                topk_weights=w.to(device),
                num_experts=num_experts,
                expert_alignment=rnd.alignment,
                num_worst_tokens=worst,
                **kw,
            )
        )
    recv_x, recv_idx, recv_w, counts, handle = out[:5]
    if not cached:
        state.handle, state.handle_round = handle, rnd
    n_recv = len(rows)
    got = recv_x[:n_recv] if not isinstance(recv_x, tuple) else (recv_x[0][:n_recv], recv_x[1][:n_recv])
    want = stacked([expected_row(src, t) for src, t in rows])
    if want is not None:
        check("recv_x", _same(got, want))
    else:
        check("recv_x rows", (got[0] if isinstance(got, tuple) else got).shape[0] == 0)
    if rnd.entry == "num_worst_tokens":
        check("num_worst_tokens rows", (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0] == worst)
        check("num_worst_tokens counts", counts == [])
    if cached:
        check("cached: no top-k returned", recv_idx is None and recv_w is None)
    elif no_topk:
        check("no top-k: recv_topk_idx/weights", recv_idx is None and recv_w is None)
        summed = [sum(int(everyone[s][4][rank * local + le]) for s in range(world)) for le in range(local)]
        check("no top-k: counts", counts == [(c + rnd.alignment - 1) // rnd.alignment * rnd.alignment for c in summed])
    else:
        want_idx = [
            [e - rank * local if e >= 0 and e // local == rank else -1 for e in everyone[s][1][t].tolist()]
            for s, t in rows
        ]
        check("recv_topk_idx", recv_idx[:n_recv].cpu().tolist() == want_idx)
        want_w = [
            [float(everyone[s][2][t, k]) if want_idx[i][k] >= 0 else 0.0 for k in range(rnd.topk)]
            for i, (s, t) in enumerate(rows)
        ]
        check("recv_topk_weights", recv_w[:n_recv].cpu().tolist() == want_w)
        if rnd.entry != "num_worst_tokens":
            ref_counts = [sum(r_.count(le) for r_ in want_idx) for le in range(local)]
            check(
                "num_recv_tokens_per_expert_list",
                counts == [(c + rnd.alignment - 1) // rnd.alignment * rnd.alignment for c in ref_counts],
            )
        check("recv_src_idx", handle.recv_src_idx[:n_recv].cpu().tolist() == [t for _, t in rows])
    # combine: every token's copies (one per rank it went to), snapped to the grid, summed exactly
    rows_x = recv_x if not isinstance(recv_x, tuple) else fp8.dequantize(*recv_x)
    y = _grid(rows_x).to(_ydtype(rnd))
    y[n_recv:] = 0
    weights = None if recv_w is None else recv_w
    combined, combined_w, _ = _wait(buffer.combine(y, handle, topk_weights=weights, **_mode(buffer, rnd.mode)))
    n = x_rows(x)
    if n:
        copies = torch.tensor([sum(sent_to(rank, t, d) for d in range(world)) for t in range(n)], dtype=torch.float32)
        ref = _grid(plain_rows(rnd, everyone[rank][0])) * copies[:, None]
        check("combine", torch.equal(combined.cpu().float(), ref))
        if weights is not None and not no_topk:
            want_cw = torch.where(idx >= 0, w, 0.0)
            check("combine weights", torch.equal(combined_w.cpu(), want_cw))
    return errors


def _ydtype(rnd: Round) -> torch.dtype:
    return torch.float32 if rnd.form == "fp32" else torch.bfloat16


def x_rows(x) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def plain_rows(rnd: Round, x) -> torch.Tensor:
    """A rank's tokens ``x`` as every receiver sees them, as float32 ``[N, H]`` (what combine's inputs are snapped
    from): FP8 rows from their dequantization, as the receivers do."""
    got = x if isinstance(x, tuple) else _received_form(rnd, x)
    return (fp8.dequantize(*got) if isinstance(got, tuple) else got).float()


def _zeros_like_row(row, rnd: Round, pad: int):
    hidden = rnd.hidden
    fp8_rows = rnd.form in ("fp8 tuple", "fp8 in send path, fp8 out")
    if fp8_rows:
        return (torch.zeros(pad, hidden, dtype=fp8.FP8_DTYPE), torch.zeros(pad, hidden // 128))
    return torch.zeros(pad, hidden, dtype=torch.float32 if rnd.form == "fp32" else torch.bfloat16)
