"""Megatron-Core's 1F1B EP-overlap schedule (``overlap_moe_expert_parallel_comm``) over one MoE transformer layer,
against the same layer run plainly: the model, config and reference the CPU test (tests/test_megatron_overlap.py,
host doubles for the schedule's streams and events) and the GPU test (tests/gpu/test_megatron_overlap_gpu.py,
Megatron's real CUDA streams and events) share. Needs ``megatron-core``; the caller initializes model parallelism
and installs the plugin."""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

HIDDEN, HEADS, EXPERTS, TOPK, FFN = 16, 2, 8, 2, 16
RELATIVE_TOLERANCE = 2**-6  # four BF16 units in the last place, as tests/test_megatron_parity.py measured
DISPATCHER_CLASSES = {"alltoall": "MoEAlltoAllTokenDispatcher", "ep_plugin": "EPPluginTokenDispatcher"}


def config(kind: str, etp: int, ep: int):
    """A BF16 ``TransformerConfig`` with the overlap flag on; ``kind`` is a dispatcher type or a flex backend."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"moe_flex_dispatcher_backend": kind} if kind in ("deepep", "hybridep") else {}
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_token_dispatcher_type="flex" if extra else kind,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
        overlap_moe_expert_parallel_comm=True,
        **extra,
    )


def build_layer(kind: str, etp: int, ep: int, seed: int, device: torch.device):
    """Megatron's local-spec MoE transformer layer with the dispatcher ``kind``, built on the CPU from ``seed`` and
    moved to ``device`` in BF16 throughout, as Megatron's ``Float16Module`` casts a ``bf16`` model (the local spec's
    norms are made in fp32, which CUDA's ``layer_norm`` refuses beside BF16 inputs)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from moe_ep_plugin.megatron import compat

    spec = get_gpt_layer_local_spec(num_experts=EXPERTS)
    assert compat.use_router([spec]) == 1
    torch.manual_seed(seed)
    return build_module(spec, config=config(kind, etp, ep), layer_number=1).to(device=device, dtype=torch.bfloat16)


def _grads(layer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _causal_mask(tokens: int, device: torch.device) -> torch.Tensor:
    # given explicitly: Megatron's default causal mask is built on CUDA
    return torch.triu(torch.ones(1, 1, tokens, tokens, dtype=torch.bool, device=device), diagonal=1)


def plain(layer, xs: Sequence[torch.Tensor], grads_out: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each micro-batch forward + backward through ``TransformerLayer.forward``: outputs, input gradients and the
    parameter gradients summed over the micro-batches."""
    result = {}
    for i, (x, grad_out) in enumerate(zip(xs, grads_out, strict=True)):
        x = x.clone().requires_grad_(True)
        out, _ = layer(x, attention_mask=_causal_mask(x.shape[0], x.device))
        out.backward(grad_out)
        result[f"output{i}"], result[f"input{i}"] = out.detach(), x.grad
    result.update(_grads(layer))
    layer.zero_grad(set_to_none=True)
    return result


class Streams:
    """What the schedule plan runs on: the compute and communication streams, a fresh event per micro-batch (as
    each model chunk's schedule plan has one), and ``settle``, called before a node's output is read on the
    current stream (on CUDA: wait for the communication stream, where the last node of a layer ends)."""

    def __init__(self, comp: object, comm: object, new_event: Callable[[], object], settle: Callable[[], None]) -> None:
        self.comp, self.comm, self.new_event, self.settle = comp, comm, new_event, settle


def scheduled(
    layer, xs: Sequence[torch.Tensor], grads_out: Sequence[torch.Tensor], streams: Streams
) -> dict[str, torch.Tensor]:
    """The two micro-batches through Megatron's schedule plan as ``combined_1f1b`` runs them: a forward; b forward
    with a backward; b backward. The same keys as :func:`plain`."""
    from megatron.core.models.common.model_chunk_schedule_plan import ModelChunkState, TransformerLayerSchedulePlan

    plans, inputs = [], [x.clone().requires_grad_(True) for x in xs]
    # megatron-core >= 0.19 (whose first node is pre_dispatch_computation) takes stream getters, 0.16 streams
    getters = hasattr(TransformerLayerSchedulePlan, "pre_dispatch_computation")
    comp, comm = ((lambda: streams.comp), (lambda: streams.comm)) if getters else (streams.comp, streams.comm)
    for x in inputs:
        chunk = ModelChunkState()  # what the model chunk's pre-process node leaves for its layers
        chunk.attention_mask = _causal_mask(x.shape[0], x.device)
        chunk.rotary_pos_emb = chunk.rotary_pos_cos = chunk.rotary_pos_sin = None
        chunk.packed_seq_params = chunk.sequence_len_offset = None
        chunk.model = types.SimpleNamespace(decoder=types.SimpleNamespace(final_layernorm=None))
        plans.append(TransformerLayerSchedulePlan(layer, streams.new_event(), chunk, comp, comm))
    run = TransformerLayerSchedulePlan.run
    result = {}
    out_a, _ = run(plans[0], None, f_input=inputs[0])
    streams.settle()
    result["output0"] = out_a.detach().clone()  # the node frees its output after backward
    out_b, result["input0"] = run(plans[1], plans[0], f_input=inputs[1], b_grad=grads_out[0])
    streams.settle()
    result["output1"] = out_b.detach().clone()
    _, result["input1"] = run(None, plans[1], b_grad=grads_out[1], is_last_layer_in_bwd=True)
    streams.settle()
    result.update(_grads(layer))
    layer.zero_grad(set_to_none=True)
    return result


def check_kinds(kinds: Sequence[str], etp: int, ep: int, seed: int, device: torch.device, streams: Streams) -> None:
    """For each dispatcher ``kind`` (the first is the reference) on this rank: the scheduled layer equals the plain
    one bitwise (outputs, input gradients, every parameter gradient), and equals the first kind's scheduled results
    within :data:`RELATIVE_TOLERANCE`. Uneven token counts over ranks and micro-batches; BF16."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    xs = [torch.randn(2 + rank % 3 + 2 * i, 1, HIDDEN, generator=gen).bfloat16() for i in range(2)]
    grads_out = [torch.randn(x.shape, generator=gen).bfloat16().to(device) for x in xs]
    xs = [x.to(device) for x in xs]
    reference = state = None
    for kind in kinds:
        layer = build_layer(kind, etp, ep, seed, device)
        assert type(layer.mlp.token_dispatcher).__name__ == DISPATCHER_CLASSES.get(kind, "MoEFlexTokenDispatcher")
        if state is None:
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        expected_all = plain(layer, xs, grads_out)
        got = scheduled(layer, xs, grads_out, streams)
        assert set(got) == set(expected_all) and len(expected_all) > 4, (kind, sorted(expected_all), sorted(got))
        for name, expected in expected_all.items():  # the same operations in the same order: bitwise
            assert torch.equal(got[name], expected), (kind, name)
        if reference is None:
            reference = got
            continue
        assert set(got) == set(reference), (kind, sorted(got), sorted(reference))
        for name, expected in reference.items():
            scale = max(float(expected.abs().max()), 1e-3)
            error = float((got[name].float() - expected.float()).abs().max()) / scale
            assert error <= RELATIVE_TOLERANCE, (kind, name, error)
