"""``ep_plugin`` beside Megatron-Core's own ``alltoall`` on one ``MoELayer``: the model, the cases and the comparison
that tests/test_megatron_parity.py runs on CPU gloo ranks and tests/gpu/test_megatron_parity_gpu.py on ranks sharing
one GPU. The same layer (same weights, same tokens) is built once per dispatcher and must give the same output and
the same gradient of the input and of every parameter; drop-and-pad also the same rows in every expert's block."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

HIDDEN, EXPERTS, TOPK, FFN = 16, 8, 2, 16
FLEX_BACKENDS = ("deepep", "hybridep")
# (drop mode, dtype, recompute): every mode in both dtypes, recompute on half of them.
CASES = (
    ("dropless", torch.bfloat16, False),
    ("capacity", torch.bfloat16, True),
    ("pad", torch.bfloat16, False),
    ("dropless", torch.float16, True),
    ("capacity", torch.float16, False),
    ("pad", torch.float16, True),
)
# Measured over every tensor, case and layout: max|plugin - alltoall| / max|alltoall| was at most two units in
# the last place of the dtype (BF16 3.8e-3, FP16 9.5e-4 at 8x1; 0 at 1x1), from summation order: alltoall sums a
# token's expert outputs and reduce-scatters the TP partials in the model dtype, the plugin sums both in fp32.
# The tolerance is four units.
RELATIVE_TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-9}


def config(kind: str, tp: int, ep: int, mode: str, dtype: torch.dtype, recompute: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # "deepep" / "hybridep": Megatron's flex dispatcher with that backend (served by install()'s shims)
    extra = {"moe_flex_dispatcher_backend": kind} if kind in FLEX_BACKENDS else {}
    kind = "flex" if extra else kind
    if mode != "dropless":
        extra.update(
            moe_expert_capacity_factor=0.5 if mode == "capacity" else 0.75,
            moe_token_drop_policy="probs",
            moe_pad_expert_input_to_capacity=mode == "pad",
        )
    if recompute:
        extra.update(recompute_granularity="selective", recompute_modules=["moe"])
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=8,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        sequence_parallel=tp > 1,
        moe_token_dispatcher_type=kind,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        **extra,
    )


def run_layer(layer, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward + backward; returns the output and the gradients of the input and every parameter."""
    seen = {}
    postprocess = layer.token_dispatcher.dispatch_postprocess

    def keep_counts(h, p):
        out = postprocess(h, p)
        seen["tokens_per_expert"] = out[1].clone()
        seen["rows"], seen["probs"] = out[0].detach().clone(), out[2].detach().clone()
        return out

    layer.token_dispatcher.dispatch_postprocess = keep_counts
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad_out)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads["input"] = x.grad
    grads.update(seen)
    return out.detach(), grads


def check_case(
    tp: int,
    ep: int,
    mode: str,
    dtype: torch.dtype,
    recompute: bool,
    seed: int,
    flex_backends: Sequence[str],
    device: torch.device,
) -> None:
    """One case: the layer with ``alltoall``, ``ep_plugin`` and each of ``flex_backends`` (Megatron's flex
    dispatcher with that backend on this library), built on the CPU from ``seed`` and moved to ``device``."""
    from moe_ep_plugin.megatron import compat

    rank = dist.get_rank()
    layers = {}
    for kind in ("alltoall", "ep_plugin", *flex_backends):
        torch.manual_seed(seed)
        layers[kind] = compat.build_moe_layer(
            compat.local_moe_spec(EXPERTS), config(kind, tp, ep, mode, dtype, recompute)
        )
        layers[kind].load_state_dict(layers["alltoall"].state_dict())
    layers = {kind: layer.to(device) for kind, layer in layers.items()}
    # Drop-and-pad needs one capacity everywhere (alltoall's fixed splits): equal token counts on every rank.
    tokens = 6 if mode == "pad" else 3 + 2 * (rank % 3)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    x = torch.randn(tokens, 1, HIDDEN, generator=gen).to(device, dtype)
    grad_out = torch.randn(tokens, 1, HIDDEN, generator=gen).to(device, dtype)
    ref_out, ref = run_layer(layers["alltoall"], x, grad_out)
    out, got = run_layer(layers["ep_plugin"], x, grad_out)
    assert set(got) == set(ref), (sorted(got), sorted(ref))
    assert torch.equal(got.pop("tokens_per_expert").cpu(), ref.pop("tokens_per_expert").cpu())
    rows, probs, ref_rows, ref_probs = got.pop("rows"), got.pop("probs"), ref.pop("rows"), ref.pop("probs")
    if mode == "pad":  # the same rows (dropped tokens, padding tokens with prob 0) in every expert's block
        capacity = -(-tokens * TOPK * 3 // (4 * EXPERTS))  # get_capacity: ceil(T * K / E * 0.75)
        assert layers["ep_plugin"].token_dispatcher._capacity == capacity  # tokens_per_expert: capacity x TP x EP
        # alltoall orders an expert's sources TP-major (EP all-to-all, then TP gather), the plugin by TP x EP
        # group rank (EP-major)
        ref_rows = ref_rows.view(-1, tp, ep, capacity, HIDDEN).transpose(1, 2).reshape(rows.shape)
        ref_probs = ref_probs.view(-1, tp, ep, capacity).transpose(1, 2).reshape(probs.shape)
        assert torch.equal(rows, ref_rows) and torch.equal(probs, ref_probs.to(probs.dtype))
    assert_close("ep_plugin", out, got, ref_out, ref, (tp, ep, mode, dtype, recompute))
    for backend in flex_backends:
        # the flex dispatchers' rows and counts have their own layouts: outputs and gradients are compared
        flex_out, flex = run_layer(layers[backend], x, grad_out)
        for name in ("tokens_per_expert", "rows", "probs"):
            flex.pop(name)
        assert_close(backend, flex_out, flex, ref_out, ref, (tp, ep, mode, dtype, recompute))


def assert_close(
    kind: str,
    out: torch.Tensor,
    got: dict[str, torch.Tensor],
    ref_out: torch.Tensor,
    ref: dict[str, torch.Tensor],
    case: tuple,
) -> None:
    """The output and every gradient of ``kind`` equal ``alltoall``'s within the tolerance of the case's dtype
    (``case``: tp, ep, mode, dtype, recompute)."""
    dtype = case[3]
    assert set(got) == set(ref), (kind, sorted(got), sorted(ref))
    for name, expected in [("output", ref_out), *ref.items()]:
        actual = out if name == "output" else got[name]
        assert actual.dtype == expected.dtype, (kind, name, actual.dtype, expected.dtype)
        scale = max(float(expected.abs().max()), 1e-3)
        error = float((actual.float() - expected.float()).abs().max()) / scale
        assert error <= RELATIVE_TOLERANCE[dtype], (kind, *case, name, error)
