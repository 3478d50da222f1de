"""Tuning knobs of the normal kernels, with DeepEP V1's names, defaults and size hints."""
from __future__ import annotations

import functools
from dataclasses import dataclass

_ALIGN = 128
# Seconds any wait on another rank may take before raising (the Buffer, the process group, every front door).
DEFAULT_TIMEOUT_S = 120.0


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Config:
    """Per-call kernel configuration (DeepEP ``Config``): SM count and chunk sizes in tokens.

    The ``torch`` transport ignores the chunk sizes; the ``nvlink`` kernels use ``num_sms`` blocks and
    ``num_max_nvl_chunked_{send,recv}_tokens`` as their per-channel queue depths.
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config.num_max_nvl_chunked_send_tokens must be < num_max_nvl_chunked_recv_tokens, got "
                             f"{self.num_max_nvl_chunked_send_tokens} >= {self.num_max_nvl_chunked_recv_tokens}")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of peer-visible buffer the NVLink kernels need for rows of ``hidden_bytes`` (DeepEP's formula)."""
        channels = max(1, self.num_sms // 2)
        peers = min(num_ranks, 8)
        rdma_ranks = max(1, num_ranks // 8)
        per_token = hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4  # row + worst-case top-k idx/weights + scales
        size = channels * peers * (2 * rdma_ranks + 3) * 4 + channels * peers * self.num_max_nvl_chunked_recv_tokens * per_token
        return _round_up(size, _ALIGN)

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
