"""Plain-loop references for dispatch and combine, computed from every rank's inputs (gathered)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_ep_plugin.ops import fp8


def gather_all(obj):
    """All-gather any picklable object (CPU tensors inside) from every rank of the default group."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def expected_dispatch(xs, idxs, weights, num_experts: int, rank: int, num_ranks: int):
    """Rows rank ``rank`` must receive: for each source rank, each of its tokens (in order) that has an expert
    on ``rank``; returns ``(rows, local_idx, local_weights, src_idx, counts_per_local_expert)``."""
    local = num_experts // num_ranks
    rows, out_idx, out_w, src = [], [], [], []
    counts = [0] * local
    for x, idx, w in zip(xs, idxs, weights, strict=False):
        for t in range(x.shape[0]):
            ids = idx[t].tolist()
            if not any(e >= 0 and e // local == rank for e in ids):
                continue
            rows.append(x[t])
            loc = [e - rank * local if e >= 0 and e // local == rank else -1 for e in ids]
            out_idx.append(loc)
            out_w.append([float(w[t, j]) if loc[j] >= 0 else 0.0 for j in range(len(ids))] if w is not None else None)
            src.append(t)
            for e in loc:
                if e >= 0:
                    counts[e] += 1
    return rows, out_idx, out_w, src, counts


def summing_order(topk_row: list[int], local: int, num_ranks: int) -> list[int]:
    """The ranks in the order combine adds a token's copies to its biases (DeepEP V2's): by the last top-k slot
    naming one of their experts (``local`` per rank), ranks named by none first, ascending."""
    last = [-1] * num_ranks
    for k, e in enumerate(topk_row):
        if 0 <= e < local * num_ranks:
            last[e // local] = k
    return sorted(range(num_ranks), key=lambda r: (last[r], r))


def routing(kind: str, n: int, k: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, k]`` int64 global expert ids: ``random`` (distinct per token, ~10% -1), ``sparse`` (~50% -1) or
    ``one_expert`` (every token to expert E-1 only)."""
    if kind == "one_expert":
        idx = torch.full((n, k), -1, dtype=torch.int64)
        idx[:, 0] = num_experts - 1
        return idx
    # Distinct experts per token; with fewer experts than K the remaining slots are -1.
    idx = torch.full((n, k), -1, dtype=torch.int64)
    for t in range(n):
        picked = torch.randperm(num_experts, generator=gen)[:k]
        idx[t, : picked.numel()] = picked
    if kind == "sparse" and n:
        idx[torch.rand(n, k, generator=gen) < 0.5] = -1
    elif n:
        idx[torch.rand(n, k, generator=gen) < 0.1] = -1
    return idx


def _dense_moe(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, experts: torch.Tensor, straight_through_fp8: bool = False
) -> torch.Tensor:
    """out[t] = Σ_k w[t, k] · (x[t] @ experts[idx[t, k]]) (-1 skipped), token by token; with
    ``straight_through_fp8`` the forward sees x through the FP8 quantizer and the gradient passes straight."""
    if straight_through_fp8 and x.shape[0]:
        x = x + (fp8.dequantize(*fp8.quantize(x.detach()), torch.float32) - x).detach()
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(experts.shape[2])
        for j, e in enumerate(idx[t].tolist()):
            if e >= 0:
                acc = acc + w[t, j] * (x[t] @ experts[e])
        rows.append(acc)
    return torch.stack(rows) if rows else torch.zeros(0, experts.shape[2])


def dense_reference(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    experts: torch.Tensor,
    straight_through_fp8: bool,
):
    """Single-process truth for an EP layer: every rank's ``(x, idx, w, g)`` gathered, ``Σ (dense_moe · g)``
    backpropagated (``experts`` ``[E, H, H]``). Returns this rank's ``(out, grad x, grad w, grad of all experts)``
    (zeros for untouched leaves)."""
    experts = experts.detach().clone().requires_grad_(True)
    leaves, total = [], 0.0
    for rx, ridx, rw, rg in gather_all((x.detach(), idx, w.detach(), g)):
        rx, rw = rx.clone().requires_grad_(True), rw.clone().requires_grad_(True)
        out = _dense_moe(rx, ridx, rw, experts, straight_through_fp8)
        total = total + (out * rg).sum()
        leaves.append((rx, rw, out))
    total.backward()
    rx, rw, out = leaves[dist.get_rank()]
    return out.detach(), _grad(rx), _grad(rw), _grad(experts)


def _grad(t: torch.Tensor) -> torch.Tensor:
    """A leaf's gradient; an empty leaf no op touched has none, which means zeros."""
    return t.grad if t.grad is not None else torch.zeros_like(t)
