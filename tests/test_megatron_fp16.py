"""Megatron-Core's own ``TestMoELayerFP16`` (``tests/unit_tests/transformer/moe/test_moe_layer.py`` of core_v0.16.1
and core_r0.19) with ``moe_token_dispatcher_type: flex`` on every backend ``install()`` serves, and with
``ep_plugin``, on CPU gloo ranks.

The case is Megatron's: hidden 64, 32 x 2 tokens, 2 or 4 experts top-2 with the aux loss (coefficient 0.01),
``SequentialMLP`` experts of the local spec (FFN 256, no bias), FP16 parameters and inputs, TP x EP 2x2 and 4x2 with
sequence parallelism (``flex`` needs TP x EP > 1: at 1x1 Megatron's own ``MoEFlexTokenDispatcher`` asserts it). Its
assertions (an fp16 output of the input's shape, an fp16 input gradient, a gradient for every parameter) hold, and
beyond them the output and every gradient equal those of Megatron's ``alltoall`` on the same layer within four
fp16 units in the last place (the fp16 tokens travel as they are and the combine sums in fp32, so only the
summation order differs: ``support/megatron_parity.py``). Megatron's test builds on CUDA
(``use_cpu_initialization=False``, ``.cuda()``); here the layer is made on the CPU, where the gloo ranks run.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.megatron_host import cuda_streams_are_host, flex_backends_on_host  # noqa: E402
from support.megatron_parity import assert_close, run_layer  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

HIDDEN, SEQUENCE, MICRO_BATCH = 64, 32, 2


def _config(kind: str, num_experts: int, tp: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {} if kind in ("alltoall", "ep_plugin") else {"moe_flex_dispatcher_backend": kind}
    if kind == "ncclep":  # megatron-core >= 0.19: the receive buffer holds every row a rank can get here
        extra["moe_expert_rank_capacity_factor"] = float(tp * ep * 2)
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=num_experts,
        use_cpu_initialization=True,
        moe_token_dispatcher_type=kind if not extra else "flex",
        moe_router_load_balancing_type="aux_loss",
        moe_router_topk=2,
        moe_aux_loss_coeff=0.01,
        moe_grouped_gemm=False,
        moe_ffn_hidden_size=256,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
        fp16=True,
        params_dtype=torch.float16,
        **extra,
    )


def _suite(tp: int, ep: int, backends: tuple[str, ...], seed: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.megatron import compat, ncclep_shim
    from moe_ep_plugin.megatron.host import cuda_device_is_host, seed_model_parallel_rng

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    try:
        with cuda_streams_are_host(), cuda_device_is_host():
            for num_experts in (2, 4):
                layers = {}
                for kind in ("alltoall", "ep_plugin", *backends):
                    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
                    torch.manual_seed(seed)
                    layers[kind] = MoELayer(
                        _config(kind, num_experts, tp, ep), compat.moe_submodules(spec.submodules.mlp)
                    )
                    layers[kind].load_state_dict(layers["alltoall"].state_dict())
                gen = torch.Generator().manual_seed(seed * 7 + dist.get_rank())
                x = torch.randn(SEQUENCE, MICRO_BATCH, HIDDEN, generator=gen).half()
                grad_out = torch.randn(SEQUENCE, MICRO_BATCH, HIDDEN, generator=gen).half()
                ref_out, ref = run_layer(layers["alltoall"], x, grad_out)
                for name in ("tokens_per_expert", "rows", "probs"):
                    ref.pop(name)
                for kind in ("ep_plugin", *backends):
                    out, got = run_layer(layers[kind], x, grad_out)
                    for name in ("tokens_per_expert", "rows", "probs"):
                        got.pop(name)
                    # Megatron's assertions
                    assert out.dtype == torch.float16 and out.shape == x.shape, (kind, out.dtype, out.shape)
                    assert got["input"].dtype == torch.float16, (kind, got["input"].dtype)
                    for name, param in layers[kind].named_parameters():
                        assert not param.requires_grad or name in got, (kind, name)
                    assert_close(kind, out, got, ref_out, ref, (tp, ep, "dropless", torch.float16, False))
                # ncclep bootstraps once per expert count (Megatron: once per model, finalized at its teardown)
                ncclep_shim.nccl_ep_finalize()
    finally:
        ep_megatron.uninstall()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2)])
def test_megatron_moe_layer_fp16_flex(tp: int, ep: int) -> None:
    from moe_ep_plugin.megatron.registration import SERVED_FLEX_BACKENDS

    backends = flex_backends_on_host(SERVED_FLEX_BACKENDS)
    spawn(_suite, tp * ep, args=(tp, ep, backends, int(time.time()) % 1000), backend="gloo", timeout_s=600)
