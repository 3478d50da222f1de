"""What the nvlink transport's kernels are sized and launched with: staged row sizes, capacities, and the
decisions (push or pull, sender warps and blocks) taken from the counts every rank sees alike. Pure functions of
plain numbers: no tensors, no library."""
from __future__ import annotations

from ...ops.library import MAX_TOPK

# Default staging: every source rank may send 8192 rows of up to hidden 8192 in BF16 with 32 top-k entries.
DEFAULT_ROWS = 8192
DEFAULT_ROW_BYTES = 8192 * 2 + 64 * 4 + 2 * MAX_TOPK * 4 + 16
MAX_REGION_ROWS = 65536


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def dispatch_slot_bytes(hidden: int, elem_bytes: int, fp8_rows: bool, num_topk: int) -> int:
    """Bytes of one staged dispatch row (csrc/intranode.cu ``SlotLayout``)."""
    payload = hidden if fp8_rows else hidden * elem_bytes
    scales = hidden // 128 if fp8_rows else 0
    return _round16(payload + 4 * scales + 8 * num_topk + 4)


def combine_row_bytes(hidden: int, elem_bytes: int, num_topk: int) -> int:
    """Region bytes per combined row: the row, then (with all rows before them) its weights."""
    return hidden * elem_bytes + 4 * num_topk


def staging_capacity(region_bytes: int, slot_bytes: int) -> int:
    """Rows of ``slot_bytes`` one peer staging region of ``region_bytes`` holds."""
    return min(region_bytes // slot_bytes, MAX_REGION_ROWS)


def most_received(host_counts: list[int], num_ranks: int) -> int:
    """The most rows any rank receives, from the whole count matrix (``host_counts[i * R + j]``: rows rank i
    sends to rank j), so every rank computes the same."""
    return max(sum(host_counts[j::num_ranks]) for j in range(num_ranks))  # column j: slices, not an index per entry


def send_blocks(blocks: int, num_sms: int) -> int:
    """Whole sender blocks when the grid of ``num_sms`` blocks has room for receivers too, else 0 (warp roles)."""
    return blocks if 0 < blocks < num_sms else 0
