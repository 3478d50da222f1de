"""Plain-loop references for dispatch and combine, computed from every rank's inputs (gathered)."""
from __future__ import annotations

import torch.distributed as dist


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
    for x, idx, w in zip(xs, idxs, weights):
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
