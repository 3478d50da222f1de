"""ctypes loader of the kernel library ``moe_ep_plugin/lib/libmoe_ep_kernels.so``: the one mirror of its C ABI
(``csrc/moe_ep.h``).

Loaded lazily on first use; nothing here imports CUDA or needs a GPU until a function is called. Only the modules
of ``moe_ep_plugin.ops`` and the nvlink transport's runtime call it.
"""

from __future__ import annotations

import ctypes
import os

LIB_NAME = "libmoe_ep_kernels.so"
LIB_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lib", LIB_NAME)
ABI_VERSION = 19
MAX_RANKS = 8
MAX_TOPK = 32
MAX_EXPERTS = 1024  # experts an expert-major notify exchanges counts for
READ_BYTES = 16384  # the most one host read brings
PERMUTE_MAX_LOCAL_EXPERTS = 1024  # expert_slots keeps per-warp counters of every local expert
PERMUTE_MAX_TOPK = 32  # permute/unpermute keep one top-k column per lane of a warp
# Element types of the rows a kernel sums (combine, unpermute, pad_sum: csrc/moe_ep.h MOE_EP_DTYPE_*)
DTYPE_FP32 = 0
DTYPE_BF16 = 1
DTYPE_FP16 = 2
PAD_MAX_SLOTS = 12288  # pad_sum keeps a token's valid slots in shared memory

# Error record codes (csrc/moe_ep.h).
ERR_BARRIER_TIMEOUT = 1
ERR_DISPATCH_TIMEOUT = 2
ERR_COMBINE_TIMEOUT = 3
ERR_WORST_TOKENS = 4
ERR_CAPACITY = 5
ERR_MISMATCH = 6
ERR_REFUSED = 7
TIMEOUTS = (ERR_BARRIER_TIMEOUT, ERR_DISPATCH_TIMEOUT, ERR_COMBINE_TIMEOUT)  # the recorded errors whose kernel traps
META_WORDS = 8  # MOE_EP_META_WORDS; the last carries a refusal code (csrc/moe_ep.h MOE_EP_ERR_REFUSED)

_p = ctypes.c_void_p
_i64 = ctypes.c_int64


class DispatchParams(ctypes.Structure):
    """``moe_ep_dispatch_params``: pointers (0 = NULL) then int64 fields, in the header's order."""

    _fields_ = (
        [
            (name, _p)
            for name in (
                "x",
                "x_scales",
                "topk_idx",
                "topk_weights",
                "rank_prefix_matrix",
                "send_list",
                "recv_x",
                "recv_scales",
                "recv_topk_idx",
                "recv_topk_weights",
                "recv_src_idx",
                "recv_expert_count",
            )
        ]
        + [
            (name, _i64)
            for name in (
                "num_tokens",
                "hidden",
                "x_elem_bytes",
                "num_topk",
                "num_local_experts",
                "list_stride",
                "num_recv_rows",
                "wire_fp8",
                "fp8_in",
                "fp8_out",
                "round_scale",
                "num_sms",
                "num_send_warps",
            )
        ]
        + [("send_pos", _p), ("expert_major", _i64)]
        + [(name, _p) for name in ("expert_pos", "send_offset", "expert_info", "recv_slot", "expert_probs")]
        + [(name, _i64) for name in ("alignment", "speculative_rows", "pull")]
    )


class CombineParams(ctypes.Structure):
    """``moe_ep_combine_params``."""

    _fields_ = (
        [
            (name, _p)
            for name in ("x", "topk_weights", "rank_prefix_matrix", "send_pos", "bias0", "bias1", "out", "out_weights")
        ]
        + [
            (name, _i64)
            for name in (
                "num_tokens",
                "hidden",
                "dtype",
                "num_topk",
                "num_recv_rows",
                "num_sms",
                "num_send_warps",
                "num_send_blocks",
                "copy_engine",
                "copy_piece_rows",
                "copy_streams",
            )
        ]
        + [
            ("host_counts", _p),
            ("pull", _i64),
            ("x_in_region", _i64),
            ("topk_idx", _p),
            ("idx_topk", _i64),
            ("num_local_experts", _i64),
        ]
    )


class LLDispatchParams(ctypes.Structure):
    """``moe_ep_ll_dispatch_params`` (low-latency dispatch)."""

    _fields_ = [
        (name, _p)
        for name in ("x", "topk_idx", "recv_x", "recv_scales", "recv_count", "src_info", "layout_range", "wait_stats")
    ] + [
        (name, _i64)
        for name in (
            "num_tokens",
            "hidden",
            "num_topk",
            "num_experts",
            "max_tokens",
            "use_fp8",
            "round_scale",
            "use_ue8m0",
            "buffer_set",
            "refusal",
        )
    ]


class LLCombineParams(ctypes.Structure):
    """``moe_ep_ll_combine_params`` (low-latency combine)."""

    _fields_ = [
        (name, _p) for name in ("x", "topk_idx", "topk_weights", "src_info", "layout_range", "out", "wait_stats")
    ] + [
        (name, _i64)
        for name in ("num_tokens", "hidden", "num_topk", "num_experts", "max_tokens", "buffer_set", "refusal")
    ]


_lib: ctypes.CDLL | None = None


def library_path() -> str:
    return os.environ.get("MOE_EP_KERNEL_LIB", LIB_PATH)


def unavailable_reason() -> str | None:
    """Why the kernel library cannot be loaded (None when it can)."""
    path = library_path()
    if not os.path.isfile(path):
        return f"kernel library {path} is not built (run `python -m moe_ep_plugin._build`)"
    try:
        load()
    except OSError as exc:
        return f"kernel library {path} failed to load: {exc}"
    return None


def load() -> ctypes.CDLL:
    """The loaded library with argument/return types declared; raises OSError if it is missing or stale."""
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(library_path())
    lib.moe_ep_abi_version.restype = ctypes.c_int
    if lib.moe_ep_abi_version() != ABI_VERSION:
        raise OSError(f"kernel library ABI {lib.moe_ep_abi_version()} != {ABI_VERSION}: rebuild it")
    lib.moe_ep_last_error.restype = ctypes.c_char_p
    lib.moe_ep_create.restype = _p
    lib.moe_ep_create.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, _i64, _i64]
    lib.moe_ep_ipc_handle.argtypes = [_p, ctypes.c_char_p]
    lib.moe_ep_open_peers.argtypes = [_p, ctypes.c_char_p]
    lib.moe_ep_destroy.argtypes = [_p]
    lib.moe_ep_error_info.restype = ctypes.POINTER(ctypes.c_int32)
    lib.moe_ep_error_info.argtypes = [_p]
    lib.moe_ep_region_bytes.restype = _i64
    lib.moe_ep_region_bytes.argtypes = [_p]
    lib.moe_ep_staging_offset.restype = _i64
    lib.moe_ep_staging_offset.argtypes = []
    lib.moe_ep_own_region.restype = _p
    lib.moe_ep_own_region.argtypes = [_p]
    lib.moe_ep_peer_region.restype = _p
    lib.moe_ep_peer_region.argtypes = [_p, ctypes.c_int]
    lib.moe_ep_read_start.argtypes = [_p, _p, _i64, _p]
    lib.moe_ep_read_wait.argtypes = [_p]
    lib.moe_ep_read_buffer.restype = ctypes.POINTER(ctypes.c_int32)
    lib.moe_ep_read_buffer.argtypes = [_p]
    lib.moe_ep_pull_rows.restype = _i64
    lib.moe_ep_pull_rows.argtypes = [_p, _i64, _i64]
    lib.moe_ep_get_dispatch_layout.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _p]
    lib.moe_ep_routing_map_topk.argtypes = [_p, _p, _i64, _i64, _i64, _p, _p, _p]
    lib.moe_ep_notify_dispatch.argtypes = [_p, _p, _p, _p, _i64, _i64, _p, _p, _p, _p, _p, _p, _i64, _p]
    lib.moe_ep_notify_experts.argtypes = [_p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p, _p, _p, _p]
    lib.moe_ep_barrier.argtypes = [_p, _p]
    lib.moe_ep_dispatch.argtypes = [_p, ctypes.POINTER(DispatchParams), _p]
    lib.moe_ep_combine.argtypes = [_p, ctypes.POINTER(CombineParams), _p]
    lib.moe_ep_expert_slots.argtypes = [_p, _i64, _i64, _i64, _i64, _p, _p, _p, _i64, _p]
    lib.moe_ep_permute.argtypes = [_p, _p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p]
    lib.moe_ep_unpermute.argtypes = [_p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p]
    lib.moe_ep_pad_select.argtypes = [_p, _i64, _i64, _i64, _p, _p, _p, _p]
    lib.moe_ep_pad_arrange.argtypes = [_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p, _p]
    lib.moe_ep_pad_sum.argtypes = [_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _p, _p, _p]
    lib.moe_ep_ll_set_bytes.restype = _i64
    lib.moe_ep_ll_set_bytes.argtypes = [_i64, _i64, _i64]
    lib.moe_ep_ll_combine_buffer.restype = _p
    lib.moe_ep_ll_combine_buffer.argtypes = [_p, _i64, _i64, _i64, _i64]
    for name in (
        "moe_ep_ipc_handle",
        "moe_ep_open_peers",
        "moe_ep_destroy",
        "moe_ep_get_dispatch_layout",
        "moe_ep_routing_map_topk",
        "moe_ep_notify_dispatch",
        "moe_ep_notify_experts",
        "moe_ep_barrier",
        "moe_ep_dispatch",
        "moe_ep_combine",
        "moe_ep_read_start",
        "moe_ep_read_wait",
        "moe_ep_expert_slots",
        "moe_ep_permute",
        "moe_ep_unpermute",
        "moe_ep_pad_select",
        "moe_ep_pad_arrange",
        "moe_ep_pad_sum",
        "moe_ep_ll_dispatch_send",
        "moe_ep_ll_dispatch_recv",
        "moe_ep_ll_combine_send",
        "moe_ep_ll_combine_recv",
        "moe_ep_ll_clean",
    ):
        getattr(lib, name).restype = ctypes.c_int
    _lib = lib
    return lib


class HostInts:
    """``values`` as a C ``int32`` array in host memory, for a library call that takes its address (``address``)
    or the array itself (``array``); alive as long as this object."""

    def __init__(self, values: list[int]) -> None:
        self.array = (ctypes.c_int32 * len(values))(*values)
        self.address = ctypes.addressof(self.array)


def ptr(t: object) -> int:
    """The device address a C call takes for tensor ``t`` (``data_ptr()``), or 0 (NULL) for None."""
    return 0 if t is None else t.data_ptr()


def check(code: int, what: str) -> None:
    """Raise ``RuntimeError`` with the library's message when a C call returned nonzero."""
    if code != 0:
        message = load().moe_ep_last_error().decode(errors="replace")
        raise RuntimeError(f"moe_ep_plugin kernels: {what} failed ({code}): {message}")
