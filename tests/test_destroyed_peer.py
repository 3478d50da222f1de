"""A Buffer destroyed on one rank (issue 46): a peer's next call on it raises naming that rank instead of timing out
— at the call on the torch and hierarchical transports, which ask the store each time; after the failed wait on
peers on a transport that does not (the kernel transports), low-latency calls included; a Buffer made after it on the
same group is not affected. 2 gloo ranks, the ``torch`` and ``hierarchical`` transports (2 emulated nodes)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from support.reference import routing
from test_faults import _healthy

from moe_ep_plugin import Buffer
from moe_ep_plugin.launch import spawn

TIMEOUT_S = 20.0
WAIT_S = 2.0  # the timeout of the buffer whose call waits for the destroyed peer
NAMED = r"Buffer: rank 1 of this group destroyed its Buffer \(destroy\(\)\)"


def _peer_destroyed(transport: str, ranks_per_node: int | None) -> None:
    rank = dist.get_rank()
    first, second = (Buffer(transport=transport, ranks_per_node=ranks_per_node, timeout_s=TIMEOUT_S) for _ in range(2))
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(6, 16, generator=gen)
    idx = routing("random", 6, 2, 4, gen)
    recv_x, _, _, _, handle, _ = first.dispatch(x, topk_idx=idx, num_experts=4)
    if rank == 1:
        first.destroy()
    dist.barrier()  # rank 1's destroy() is done before rank 0 calls
    if rank == 0:
        start = time.monotonic()
        calls = [
            lambda: first.dispatch(x, topk_idx=idx, num_experts=4),
            lambda: first.dispatch(x, handle=handle),
            lambda: first.combine(recv_x, handle),
            lambda: first.get_dispatch_layout(idx, 4),
        ]
        for call in calls:
            with pytest.raises(RuntimeError, match=NAMED):
                call()
        assert time.monotonic() - start < TIMEOUT_S  # at the call, not after a timeout
    _healthy(second, 5)
    if transport != "torch":
        return

    # A transport that asks only once a wait on peers failed (as the kernel transports, whose low-latency calls
    # too): the timeout is raised as the destroyed peer.
    third = Buffer(
        transport="torch",
        timeout_s=WAIT_S,
        low_latency_mode=True,
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(8, 16, 2, 4),
        num_qps_per_rank=2,
    )
    if rank == 1:
        third.destroy()
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        third.transport.checks_peers_each_call = False
        calls = [
            lambda: third.dispatch(x, topk_idx=idx, num_experts=4),
            lambda: third.low_latency_dispatch(x.to(torch.bfloat16), idx, 8, 4, use_fp8=False),
        ]
        for call in calls:
            with pytest.raises(RuntimeError, match=NAMED) as raised:
                call()
            assert isinstance(raised.value.__cause__, TimeoutError)

        def recorded() -> None:  # as the kernel transports raise a timeout their kernels recorded, at the next call
            raise TimeoutError("moe_ep_plugin: a wait on rank 1 timed out")

        third.transport.check_error = recorded
        with pytest.raises(RuntimeError, match=NAMED) as raised:
            third.dispatch(x, topk_idx=idx, num_experts=4)
        assert isinstance(raised.value.__cause__, TimeoutError)
        store.set("test/checked", "1")
    else:
        store.wait(["test/checked"])  # rank 1 keeps its side of the group up until rank 0 has checked


@pytest.mark.parametrize("transport, ranks_per_node", [("torch", None), ("hierarchical", 1)])
def test_a_peer_call_names_the_rank_that_destroyed_the_buffer(transport: str, ranks_per_node: int | None) -> None:
    spawn(_peer_destroyed, 2, args=(transport, ranks_per_node), backend="gloo", timeout_s=60)
