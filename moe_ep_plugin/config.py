"""Per-call tuning of the normal kernels: DeepEP V1's ``Config`` (names, defaults, size hints) and the nvlink
transport's ``NVLinkTuning`` it carries."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

_ALIGN = 128
MAX_COPY_STREAMS = 4  # csrc/moe_ep.h MOE_EP_MAX_COPY_STREAMS (tests/test_kernel_library.py checks it)
WARPS_PER_BLOCK = 16  # csrc/kernels/intranode.cuh kThreads / 32


# Seconds any wait on another rank may take before raising (the Buffer, the process group, every front door).
DEFAULT_TIMEOUT_S = 120.0


def round_up(x, a: int):
    """``x`` (an int or an integer tensor) rounded up to a multiple of ``a`` >= 1: the one rounding rule (row
    alignment, buffer sizes, expert-block padding)."""
    return (x + a - 1) // a * a


def positive_int(value: object, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    """The one check of an int argument: ``value`` when it is an int in ``[minimum, maximum]``; a TypeError naming
    ``name`` when it is no int (a bool is none), else a ValueError."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {value!r} ({type(value).__name__})")
    if value < minimum or (maximum is not None and value > maximum):
        what = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{name}: expected {what}{'' if maximum is None else f' <= {maximum}'}, got {value!r}")
    return value


def check_num_sms(value: object, name: str) -> int:
    """The one rule for an SM count, wherever it is given: a positive even int (two SMs per channel, as DeepEP)."""
    if positive_int(value, name) % 2:
        raise ValueError(f"{name}: expected a positive even int, got {value!r}")
    return value


@dataclass(frozen=True)
class NVLinkTuning:
    """How the ``nvlink`` kernels split their roles and move rows (``transports/nvlink/plan.py`` decides from it).
    Defaults: the fastest settings measured on 2 x H200 at 24 SMs (benchmarks/RESULTS.md, docs/kernels.md).

    - ``*_send_warps``: of the 16 warps of every block, how many send (the rest receive); ``combine_send_blocks``
      > 0 (and below the grid's ``num_sms``): that many whole blocks send a combine's rows instead. A dispatch
      that quantizes in the send path has its own warp count (``quantizing_``), and another when its receivers
      dequantize again (``dequantizing_``).
    - ``dispatch_pull`` / ``quantizing_dispatch_pull``: senders stage rows in their own region with
      ``pull_dispatch_send_warps`` warps and receivers load them over NVLink (BF16/FP32 and FP8 input / quantizing).
    - ``combine_pull``: every warp reduces, loading peers' rows over NVLink, when the most rows any rank received
      carry at least ``pull_combine_min_bytes`` and fit the own region (its two extra launches cost small,
      host-bound combines more than they save).
    - ``copy_engine_combine_below_sms``: with fewer SMs than this the copy engines carry every combined row
      (``copy_streams`` streams, pieces of at least ``copy_piece_rows`` rows) and every warp reduces; 0 = never.
    """

    dispatch_send_warps: int = 6
    quantizing_dispatch_send_warps: int = 11
    dequantizing_dispatch_send_warps: int = 10
    combine_send_warps: int = 6
    combine_send_blocks: int = 10
    dispatch_pull: bool = True
    quantizing_dispatch_pull: bool = False
    pull_dispatch_send_warps: int = 6
    combine_pull: bool = True
    pull_combine_min_bytes: int = 16 << 20
    copy_engine_combine_below_sms: int = 20
    copy_piece_rows: int = 512
    copy_streams: int = 2

    def __post_init__(self) -> None:
        for name in (
            "dispatch_send_warps",
            "quantizing_dispatch_send_warps",
            "dequantizing_dispatch_send_warps",
            "pull_dispatch_send_warps",
        ):
            positive_int(getattr(self, name), f"NVLinkTuning.{name}", 1, WARPS_PER_BLOCK - 1)
        positive_int(self.combine_send_warps, "NVLinkTuning.combine_send_warps", 1, WARPS_PER_BLOCK - 1)
        for name in ("combine_send_blocks", "pull_combine_min_bytes", "copy_engine_combine_below_sms"):
            positive_int(getattr(self, name), f"NVLinkTuning.{name}", 0)
        positive_int(self.copy_piece_rows, "NVLinkTuning.copy_piece_rows", 1)
        positive_int(self.copy_streams, "NVLinkTuning.copy_streams", 1, MAX_COPY_STREAMS)
        for name in ("dispatch_pull", "quantizing_dispatch_pull", "combine_pull"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"NVLinkTuning.{name}: expected a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Config:
    """Per-call kernel configuration (DeepEP ``Config``): SM count, chunk sizes in tokens, and the ``nvlink``
    transport's tuning.

    ``num_sms``: blocks of the ``nvlink`` kernels (at most the device's SMs); a positive even int. The four
    ``num_max_*_chunked_*_tokens`` fields are accepted for DeepEP compatibility and validated, but no kernel reads
    them (the nvlink kernels move fixed 4-row chunks); ``get_nvl_buffer_size_hint`` uses
    ``num_max_nvl_chunked_recv_tokens`` in DeepEP's formula. The ``torch`` transport ignores every field.

    ``hierarchical_chunks``: the ``hierarchical`` transport splits each rank's tokens into this many contiguous
    chunks and pipelines its two stages over them (the inter-node exchange of one chunk in flight while the
    intra-node stage of the previous one runs); 1 = the two stages one after the other. Read by an uncached
    dispatch only: a cached dispatch and combine replay the chunking of the handle they are given. Every rank must
    pass the same value (a dispatch raises on every rank otherwise). Measurement: docs/multinode.md.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256
    nvlink: NVLinkTuning = field(default_factory=NVLinkTuning)
    hierarchical_chunks: int = 1

    def __post_init__(self) -> None:
        check_num_sms(self.num_sms, "Config.num_sms")
        positive_int(self.hierarchical_chunks, "Config.hierarchical_chunks", 1)
        for name in (
            "num_max_nvl_chunked_send_tokens",
            "num_max_nvl_chunked_recv_tokens",
            "num_max_rdma_chunked_send_tokens",
            "num_max_rdma_chunked_recv_tokens",
        ):
            positive_int(getattr(self, name), f"Config.{name}", 1)
        if not isinstance(self.nvlink, NVLinkTuning):
            raise TypeError(f"Config.nvlink: expected an NVLinkTuning, got {type(self.nvlink).__name__}")
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_send_tokens must be < num_max_nvl_chunked_recv_tokens, got "
                f"{self.num_max_nvl_chunked_send_tokens} >= {self.num_max_nvl_chunked_recv_tokens}"
            )

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of peer-visible buffer the NVLink kernels need for rows of ``hidden_bytes`` (DeepEP's formula)."""
        channels = max(1, self.num_sms // 2)
        peers = min(num_ranks, 8)
        rdma_ranks = max(1, num_ranks // 8)
        per_token = hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4  # row + worst-case top-k idx/weights + scales
        size = (
            channels * peers * (2 * rdma_ranks + 3) * 4
            + channels * peers * self.num_max_nvl_chunked_recv_tokens * per_token
        )
        return round_up(size, _ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA bytes: none while all ranks share one host (the only case these kernels serve)."""
        if num_ranks <= 8:
            return 0
        raise ValueError(f"num_ranks={num_ranks}: inter-node (RDMA) normal kernels are not provided")


_DISPATCH_TABLE = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
_COMBINE_TABLE = {2: (10, 256), 4: (9, 256), 8: (4, 256)}


def tuned_config(table: dict[int, tuple[int, int]], num_sms: int, num_ranks: int) -> Config:
    send, recv = table.get(num_ranks, (6, 256))
    return Config(num_sms, send, recv, 6, 128)


# Cached: every dispatch and combine asks for its default config, and building (validating) one costs more host
# time than the rest of the Buffer's per-call checks; a Config is frozen, so callers can share it. Typed, so that
# a num_sms of 24.0 or True still fails validation instead of hitting the entry of 24 or 1.
@functools.lru_cache(maxsize=None, typed=True)
def dispatch_config(num_sms: int, num_ranks: int) -> Config:
    return tuned_config(_DISPATCH_TABLE, num_sms, num_ranks)


@functools.lru_cache(maxsize=None, typed=True)
def combine_config(num_sms: int, num_ranks: int) -> Config:
    return tuned_config(_COMBINE_TABLE, num_sms, num_ranks)
