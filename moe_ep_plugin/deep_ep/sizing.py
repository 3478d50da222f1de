"""The analytic model behind ``ElasticBuffer.get_buffer_size_hint`` and ``get_theoretical_num_sms``: peer-memory
bytes of this library's chunked rings, and the SMs that keep the NVLink busy under its kernels."""

from __future__ import annotations

import math

import torch

from ..buffer_cache import nvl_bytes_hint
from ..config import positive_int, round_up

BUFFER_ALIGNMENT = 2 << 20  # DeepEP sizes its buffers in 2 MB units; the hint keeps that granularity
DEFAULT_NVLINK_GBS = 450.0  # one direction of an H100/H200's NVLink 4: the link the SM model fills
MIN_NUM_SMS = 2  # one send and one receive block: the smallest grid of this library's kernels


def buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> int:
    """Peer-memory bytes for rows of ``hidden`` BF16 values over ``num_ranks`` ranks, 2 MB aligned (the rings
    are chunked, so the size grows with neither ``num_max_tokens_per_rank`` nor ``num_topk``: both validated)."""
    positive_int(num_max_tokens_per_rank, "num_max_tokens_per_rank", 0)
    positive_int(hidden, "hidden", 1)
    positive_int(num_topk, "num_topk", 0)
    return round_up(nvl_bytes_hint(num_ranks, hidden * 2), BUFFER_ALIGNMENT)


def _check_bandwidths(rdma_gbs: float, nvlink_gbs: float, sm_read_gbs: float, sm_write_gbs: float) -> None:
    for name, value in (("rdma_gbs", rdma_gbs), ("nvlink_gbs", nvlink_gbs)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}: expected a bandwidth >= 0 (0: default), got {value!r}")
    for name, value in (("sm_read_gbs", sm_read_gbs), ("sm_write_gbs", sm_write_gbs)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}: expected a positive bandwidth, got {value!r}")


def theoretical_num_sms(
    num_ranks: int,
    num_scaleup_ranks: int,
    device: torch.device,
    num_experts: int,
    num_topk: int,
    num_scaleout_topk: int,
    rdma_gbs: float,
    nvlink_gbs: float,
    sm_read_gbs: float,
    sm_write_gbs: float,
) -> int:
    """An even SM count for ``num_ranks`` ranks, ``num_scaleup_ranks`` of them per node, on ``device``
    (``ElasticBuffer.get_theoretical_num_sms`` documents the model and the other arguments)."""
    positive_int(num_experts, "num_experts", 1)
    positive_int(num_topk, "num_topk", 1)
    if num_scaleout_topk != 0:
        raise ValueError("num_scaleout_topk: only 0 is modelled (uniform routing)")
    _check_bandwidths(rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts: {num_experts} is not a multiple of the {num_ranks} ranks")
    peers = num_scaleup_ranks
    if peers <= 1:
        return MIN_NUM_SMS  # no NVLink traffic to keep busy
    remote_share = (peers - 1) / peers
    ring_gbs = (nvlink_gbs or DEFAULT_NVLINK_GBS) / remote_share
    pairs = max(math.ceil(ring_gbs / sm_write_gbs), math.ceil(ring_gbs / sm_read_gbs))
    num_sms = max(MIN_NUM_SMS, 2 * pairs)
    if device.type == "cuda":
        device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        num_sms = min(num_sms, device_sms // 2 * 2)
    return num_sms


__all__ = ["BUFFER_ALIGNMENT", "DEFAULT_NVLINK_GBS", "MIN_NUM_SMS", "buffer_size_hint", "theoretical_num_sms"]
