"""``ep_plugin`` beside Megatron-Core's own ``alltoall`` dispatcher on CPU gloo ranks (the model, cases and comparison:
``support/megatron_parity.py``): the same ``MoELayer`` (same weights, same tokens) built twice must give the same
output and the same gradient of the input and of every parameter. So must Megatron's ``flex`` dispatcher with the
``deepep`` and ``hybridep`` backends on this library, in BF16 and FP16 (:func:`_flex_backends`).

Layouts TP x EP 1x8, 8x1, 4x2, 2x2, 1x1 with expert tensor parallelism equal to TP (Megatron's default) and
sequence parallelism; per layout: dropless, capacity dropping and drop-and-pad, in BF16 and FP16, half of them under
``moe_layer_recompute``. Drop-and-pad also checks the fixed per-expert row count (capacity x TP x EP).

Megatron's ``alltoall`` runs on CPU with a device mapping: ``host.cuda_device_is_host`` (its TP gathers allocate on
``torch.cuda.current_device()``) and :func:`support.megatron_host.cuda_streams_are_host` (its token-count copies go
through ``torch.cuda`` streams and come back as numpy split sizes, recompute saves the CUDA RNG state, and its
expert-TP gather and reduce-scatter have per-rank sizes, which gloo does not take).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.megatron_host import cuda_streams_are_host, flex_backends_on_host  # noqa: E402
from support.megatron_parity import CASES, FLEX_BACKENDS, check_case  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402


def _flex_backends(tp: int, ep: int, mode: str, dtype: torch.dtype) -> tuple[str, ...]:
    """The flex backends a case runs with: Megatron's flex needs TP x EP > 1 and refuses drop-and-pad with
    ``deepep``; BF16 and FP16 (FP16 rows moved as they are, as BF16's). ``install()`` refuses
    drop-and-pad with ``hybridep`` at expert TP > 1: Megatron's ``_HybridEPManager`` (0.16.1 and 0.19.2) sizes its
    capacity from TP x E experts while the router pads to the capacity of E (docs/compat.md). Without CUDA,
    megatron-core >= 0.19 runs ``deepep`` only (:func:`support.megatron_host.flex_backends_on_host`)."""
    if tp * ep == 1:
        return ()
    return tuple(b for b in flex_backends_on_host(FLEX_BACKENDS) if mode != "pad" or (b == "hybridep" and tp == 1))


def _suite(tp: int, ep: int, seed: int) -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.megatron.host import cuda_device_is_host, seed_model_parallel_rng

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    try:
        with cuda_streams_are_host(), cuda_device_is_host():
            for i, (mode, dtype, recompute) in enumerate(CASES):
                check_case(
                    tp, ep, mode, dtype, recompute, seed + i, _flex_backends(tp, ep, mode, dtype), torch.device("cpu")
                )
    finally:
        ep_megatron.uninstall()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(1, 8), (8, 1), (4, 2), (2, 2), (1, 1)])
def test_moe_layer_matches_megatron_alltoall(tp: int, ep: int) -> None:
    spawn(_suite, tp * ep, args=(tp, ep, int(time.time()) % 1000), backend="gloo", timeout_s=600)
