"""What the nvlink transport's kernels are sized and launched with: staged row sizes, capacities, and the
decisions (push, pull or copy engine; sender warps and blocks) taken from the call's ``NVLinkTuning``
(``Config.nvlink``) and the counts every rank sees alike. Pure functions of plain numbers: no tensors, no
library."""

from __future__ import annotations

from collections.abc import Callable

from ...config import NVLinkTuning, round_up
from ...ops.library import MAX_TOPK

# Default staging: every source rank may send 8192 rows of up to hidden 8192 in BF16 with 32 top-k entries.
DEFAULT_ROWS = 8192
DEFAULT_ROW_BYTES = 8192 * 2 + 64 * 4 + 2 * MAX_TOPK * 4 + 16
MAX_REGION_ROWS = 65536
STAGING_HEADROOM = 8 << 20


def dispatch_slot_bytes(hidden: int, elem_bytes: int, fp8_rows: bool, num_topk: int) -> int:
    """Bytes of one staged dispatch row (``SlotLayout`` in csrc/kernels/intranode.cuh, filled in csrc/api.cu)."""
    payload = hidden if fp8_rows else hidden * elem_bytes
    scales = hidden // 128 if fp8_rows else 0
    return round_up(payload + 4 * scales + 8 * num_topk + 4, 16)


def staging_bytes(num_ranks: int, rows: int, slot_bytes: int) -> int:
    """Peer-buffer bytes (``num_nvl_bytes``) whose staging gives each of ``num_ranks`` source ranks a region of
    ``rows`` slots of ``slot_bytes``: the header, counts and flags before the staging (csrc/common.cuh
    ``kStagingOffset``) take less than ``STAGING_HEADROOM``, and each region is rounded to 4096 bytes."""
    return STAGING_HEADROOM + num_ranks * round_up(rows * slot_bytes + 4096, 4096)


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


# How one combine launch moves rows: ``(pull, copy_engine, num_send_warps, num_send_blocks)``: receivers load
# peers' rows over NVLink; the copy engines carry every combined row; sender warps per block and whole sender
# blocks (0 and 0: every warp receives or reduces).
Roles = tuple[bool, bool, int, int]


def dispatch_roles(tuning: NVLinkTuning, wire_fp8: bool, fp8_out: bool) -> tuple[bool, int]:
    """A dispatch's ``(pull, num_send_warps)``: pull when the tuning says so for this mode, else push with the
    mode's sender warps (quantizing senders do more work, and dequantizing receivers too)."""
    if tuning.quantizing_dispatch_pull if wire_fp8 else tuning.dispatch_pull:
        return True, tuning.pull_dispatch_send_warps
    if not wire_fp8:
        return False, tuning.dispatch_send_warps
    return False, tuning.quantizing_dispatch_send_warps if fp8_out else tuning.dequantizing_dispatch_send_warps


def combine_roles(
    tuning: NVLinkTuning, num_sms: int, most_rows: int | None, row_bytes: int, pull_capacity: Callable[[], int]
) -> Roles:
    """A combine's roles. ``most_rows``: the most rows any rank received (None when the counts are not on the host:
    a ``num_worst_tokens`` handle or another transport's handle), which the copy engines and the
    pull need; every rank decides alike. Copy engines first (below ``copy_engine_combine_below_sms``), then pull
    (rows of at least ``pull_combine_min_bytes`` in all that fit the own region: ``pull_capacity()`` rows, asked
    only then), else push."""
    if most_rows is not None and num_sms < tuning.copy_engine_combine_below_sms:
        return False, True, 0, 0
    if (
        tuning.combine_pull
        and most_rows is not None
        and most_rows * row_bytes >= tuning.pull_combine_min_bytes
        and most_rows <= pull_capacity()
    ):
        return True, False, 0, 0
    return False, False, tuning.combine_send_warps, send_blocks(tuning.combine_send_blocks, num_sms)
