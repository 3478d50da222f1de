"""A Buffer destroyed on one rank, on the ``nvlink`` transport (issue 46; the GPU side of tests/test_destroyed_peer.py):
rank 0's next call raises ``RuntimeError`` naming rank 1, with the kernels' timeout as its cause, after the Buffer's
short ``timeout_s``. 2 ranks (sharing the GPU, or one per GPU), gloo.

What the kernel transports allow to be observed, read from buffer.py, transports/nvlink/runtime.py and
csrc/common.cuh:

- ``destroy()`` is collective there: each kernel context (the normal one; with ``low_latency_mode`` also the
  low-latency one) frees its peer buffer after a barrier of the group. Rank 1 alone would wait in that barrier, and
  the store key naming it is written only after it; so rank 0 joins those barriers (``dist.barrier``, one per
  context) and waits for rank 1's word that ``destroy()`` returned, then calls its own side, still live.
- The kernel transports do not ask the store before a call: rank 0's kernel waits for rank 1 until ``timeout_s``,
  records the timeout in host-mapped memory and traps, which ends rank 0's CUDA context. A fresh dispatch reads
  counts on the host inside the call, so that call fails, the record becomes the ``TimeoutError`` and ``Buffer._run``
  raises it as the destroyed peer. A low-latency dispatch reads nothing on the host: it returns, reading its rows
  then fails (the trap), and the next low-latency call raises the named error from the record.
- Nothing else can run on rank 0's GPU afterwards (its context is lost), so the CPU test's last check, a Buffer made
  after it working, cannot be made here; rank 0 does not destroy its Buffer (that synchronizes the lost context).
- The trap ends every client of the GPU under MPS: run these without MPS (their names hold ``peer``, which the MPS
  command of docs/gpu_testing.md leaves out).

Should rank 0's writes into rank 1's freed peer buffer (its CUDA-IPC mapping outlives rank 1's ``cudaFree``) fault
instead of landing, the named error still comes, with a CUDA error as its cause: the cause check says so.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402
from support.settle import settle  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402

pytestmark = NEEDS_KERNELS
WAIT_S = 5.0  # the Buffer's timeout_s: how long rank 0's kernel waits for the destroyed peer
NAMED = r"Buffer: rank 1 of this group destroyed its Buffer \(destroy\(\)\)"
TOKENS, HIDDEN, EXPERTS = 8, 2048, 4


def _peer_destroyed(low_latency: bool) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank % GPUS)
    torch.cuda.set_device(device)
    ll = (
        dict(
            low_latency_mode=True,
            num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, dist.get_world_size(), EXPERTS),
        )
        if low_latency
        else {}
    )
    buffer = Buffer(dist.group.WORLD, transport="nvlink", timeout_s=WAIT_S, device=str(device), **ll)
    gen = torch.Generator(device).manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=gen, device=device).bfloat16()
    idx = torch.arange(2 * TOKENS, device=device).reshape(TOKENS, 2) % EXPERTS  # two distinct experts a token
    if low_latency:  # lays the buffer out (the host agreement), so the next calls run on the kernels alone
        buffer.clean_low_latency_buffer(TOKENS, HIDDEN, EXPERTS)
    else:  # a healthy round first
        recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=idx, num_experts=EXPERTS)
        buffer.combine(recv_x, handle)
    settle(buffer)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        buffer.destroy()
        store.set("test/destroyed", "1")
        store.wait(["test/checked"])  # keep rank 1's side of the group up until rank 0 has checked
        return
    try:
        for _ in range(2 if low_latency else 1):  # rank 1's destroy(): a barrier per kernel context
            dist.barrier()
        store.wait(["test/destroyed"])
        start = time.monotonic()
        if low_latency:
            recv_x = buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=False)[0]
            with pytest.raises(RuntimeError):  # the receive timed out and trapped: its rows cannot be read
                recv_x.float().sum().item()
            call = lambda: buffer.low_latency_dispatch(x, idx, TOKENS, EXPERTS, use_fp8=False)  # noqa: E731
        else:
            call = lambda: buffer.dispatch(x, topk_idx=idx, num_experts=EXPERTS)  # noqa: E731
        with pytest.raises(RuntimeError, match=NAMED) as raised:
            call()
        cause = raised.value.__cause__
        assert isinstance(cause, TimeoutError) and "rank 1" in str(cause), (
            f"the named error's cause: expected the kernels' TimeoutError naming rank 1, got {cause!r}"
        )
        assert time.monotonic() - start < 4 * WAIT_S
    finally:
        store.set("test/checked", "1")


@pytest.mark.parametrize("low_latency", [False, True], ids=["dispatch", "low-latency-dispatch"])
def test_nvlink_peer_destroyed_buffer_is_named(low_latency: bool) -> None:
    spawn(_peer_destroyed, 2, args=(low_latency,), backend="gloo", timeout_s=120.0)
