"""``overlap_moe_expert_parallel_comm``: Megatron-Core's own 1F1B EP-overlap schedule over a MoE transformer layer.

Megatron splits the layer into the nodes of its fine-grained callables (attention + router + ``mlp.preprocess``,
``mlp.dispatch``, ``mlp.routed_experts_compute``, ``mlp.combine`` + ``mlp.postprocess``), detaches every node's
inputs, frees some of them after forward and runs backward node by node, one micro-batch's forward interleaved
with the other's backward. Here ``TransformerLayerSchedulePlan.run`` drives it as ``combined_1f1b`` does:
micro-batch a forward alone, then b's forward interleaved with a's backward, then b's backward alone. Outputs, the
input gradients and every parameter gradient (summed over both micro-batches) must equal the same layer run
plainly (forward + backward per micro-batch), bitwise, for ``ep_plugin``, ``alltoall``, ``flex`` + ``deepep`` and
``flex`` + ``hybridep`` on this library; and each must equal ``alltoall`` under the same schedule within the
tolerance of tests/test_megatron_parity.py. BF16 (the schedule takes bf16 or fp16 models), CPU gloo ranks, uneven
token counts per rank.

The schedule's CUDA streams, events, NVTX ranges and ``record_stream`` are replaced by host doubles
(``support.megatron_host.overlap_schedule_is_host``); on CPU each node's work is done when it returns, so what is
not exercised here is the concurrency of the two streams itself (a node's kernels racing the other stream's).
"""
from __future__ import annotations

import time
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.megatron_host import HostEvent, flex_backends_on_host, overlap_schedule_is_host  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

HIDDEN, HEADS, EXPERTS, TOPK, FFN = 16, 2, 8, 2, 16
# deepep / hybridep: flex with that backend (without CUDA, megatron-core >= 0.19 builds deepep's only)
KINDS = ("alltoall", "ep_plugin", *flex_backends_on_host(("deepep", "hybridep")))
RELATIVE_TOLERANCE = 2 ** -6  # four BF16 units in the last place, as tests/test_megatron_parity.py measured


def _config(kind: str, etp: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig
    extra = {"moe_flex_dispatcher_backend": kind} if kind in ("deepep", "hybridep") else {}
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type="flex" if extra else kind,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32",
        moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True, overlap_moe_expert_parallel_comm=True,
        **extra)


def _build_layer(kind: str, etp: int, ep: int, seed: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from moe_ep_plugin.megatron import compat
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS)
    assert compat.use_router([spec]) == 1
    torch.manual_seed(seed)
    return build_module(spec, config=_config(kind, etp, ep), layer_number=1)


def _grads(layer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _causal_mask(tokens: int) -> torch.Tensor:
    # given explicitly: Megatron's default causal mask is built on CUDA
    return torch.triu(torch.ones(1, 1, tokens, tokens, dtype=torch.bool), diagonal=1)


def _plain(layer, xs, grads_out) -> dict[str, torch.Tensor]:
    """Each micro-batch forward + backward through ``TransformerLayer.forward``."""
    result = {}
    for i, (x, grad_out) in enumerate(zip(xs, grads_out, strict=True)):
        x = x.clone().requires_grad_(True)
        out, _ = layer(x, attention_mask=_causal_mask(x.shape[0]))
        out.backward(grad_out)
        result[f"output{i}"], result[f"input{i}"] = out.detach(), x.grad
    result.update(_grads(layer))
    layer.zero_grad(set_to_none=True)
    return result


def _scheduled(layer, xs, grads_out, stream) -> dict[str, torch.Tensor]:
    """The two micro-batches through Megatron's schedule plan: a forward; b forward with a backward; b backward."""
    from megatron.core.models.common.model_chunk_schedule_plan import ModelChunkState, TransformerLayerSchedulePlan
    plans, inputs = [], [x.clone().requires_grad_(True) for x in xs]
    # megatron-core >= 0.19 (whose first node is pre_dispatch_computation) takes stream getters, 0.16 streams
    streams = (lambda: stream) if hasattr(TransformerLayerSchedulePlan, "pre_dispatch_computation") else stream
    for x in inputs:
        chunk = ModelChunkState()  # what the model chunk's pre-process node leaves for its layers
        chunk.attention_mask = _causal_mask(x.shape[0])
        chunk.rotary_pos_emb = chunk.rotary_pos_cos = chunk.rotary_pos_sin = None
        chunk.packed_seq_params = chunk.sequence_len_offset = None
        chunk.model = types.SimpleNamespace(decoder=types.SimpleNamespace(final_layernorm=None))
        plans.append(TransformerLayerSchedulePlan(layer, HostEvent(), chunk, streams, streams))
    run = TransformerLayerSchedulePlan.run
    result = {}
    out_a, _ = run(plans[0], None, f_input=inputs[0])
    result["output0"] = out_a.detach().clone()  # the node frees its output after backward
    out_b, result["input0"] = run(plans[1], plans[0], f_input=inputs[1], b_grad=grads_out[0])
    result["output1"] = out_b.detach().clone()
    _, result["input1"] = run(None, plans[1], b_grad=grads_out[1], is_last_layer_in_bwd=True)
    result.update(_grads(layer))
    layer.zero_grad(set_to_none=True)
    return result


def _suite(etp: int, ep: int, seed: int) -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.megatron.host import cuda_device_is_host, seed_model_parallel_rng
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    rank = dist.get_rank()
    try:
        with overlap_schedule_is_host() as stream, cuda_device_is_host():
            gen = torch.Generator().manual_seed(seed * 31 + rank)
            # uneven token counts over ranks and micro-batches
            xs = [torch.randn(2 + rank % 3 + 2 * i, 1, HIDDEN, generator=gen).bfloat16() for i in range(2)]
            grads_out = [torch.randn(x.shape, generator=gen).bfloat16() for x in xs]
            reference = None
            for kind in KINDS:
                layer = _build_layer(kind, etp, ep, seed)
                assert type(layer.mlp.token_dispatcher).__name__ == {
                    "alltoall": "MoEAlltoAllTokenDispatcher", "ep_plugin": "EPPluginTokenDispatcher"}.get(
                    kind, "MoEFlexTokenDispatcher")
                if reference is None:
                    state = layer.state_dict()
                else:
                    layer.load_state_dict(state)
                plain = _plain(layer, xs, grads_out)
                scheduled = _scheduled(layer, xs, grads_out, stream)
                assert set(scheduled) == set(plain) and len(plain) > 4, (kind, sorted(plain), sorted(scheduled))
                for name, expected in plain.items():  # the same operations in the same order: bitwise
                    assert torch.equal(scheduled[name], expected), (kind, name)
                if reference is None:
                    reference = scheduled
                    continue
                assert set(scheduled) == set(reference), (kind, sorted(scheduled), sorted(reference))
                for name, expected in reference.items():
                    scale = max(float(expected.abs().max()), 1e-3)
                    error = float((scheduled[name].float() - expected.float()).abs().max()) / scale
                    assert error <= RELATIVE_TOLERANCE, (kind, name, error)
    finally:
        ep_megatron.uninstall()
        ps.destroy_model_parallel()


@pytest.mark.parametrize("etp,ep", [(1, 2), (2, 2)])
def test_overlap_schedule_matches_plain_layer(etp: int, ep: int) -> None:
    """Expert TP x EP 1x2 and 2x2 (attention data-parallel: Megatron's local specs have no sequence-parallel
    norm, which tensor parallelism with experts requires)."""
    spawn(_suite, etp * ep, args=(etp, ep, int(time.time()) % 1000), backend="gloo", timeout_s=600)
