"""Megatron-Core's own ``MoELayer`` with this library's dispatcher, on CPU ranks joined by gloo.

The layer is built by Megatron from its local (no TransformerEngine) spec: ``TopKRouter`` (as
``PortableTopKRouter``, which only keeps Megatron's tensors off CUDA), ``SequentialMLP`` experts with SwiGLU,
a shared expert, DeepSeek-V3 routing (sigmoid, groups, expert bias, scaling). Its output and the gradients of
the input, the router, the shared expert and every expert weight must equal a plain-loop reference in which
each token is run through each of its selected experts locally (all experts' weights gathered on every rank);
``tokens_per_expert`` must equal Megatron's count from its routing map. Both entry points are checked:
``moe_token_dispatcher_type: ep_plugin`` and the unchanged ``flex`` dispatcher with the ``deepep`` and ``hybridep``
backends served by the shims (``ncclep`` on megatron-core >= 0.19, ``deepepv2`` on Megatron-LM dev). Equality with
Megatron's own ``alltoall`` (on CPU with host doubles for its CUDA streams) is tests/test_megatron_parity.py's.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.megatron_host import flex_backends_on_host  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

HIDDEN, EXPERTS, TOPK, GROUPS, GROUP_TOPK, FFN = 16, 8, 3, 4, 2, 8
FLEX_KINDS = ("flex", "hybridep", "ncclep", "deepepv2")


def _config(world: int, kind: str, capacity: float | None, overlap: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # "flex": flex + deepep; "hybridep"/"ncclep"/"deepepv2": flex with that backend (all served by install()'s shims)
    extra = {"moe_flex_dispatcher_backend": "deepep" if kind == "flex" else kind} if kind in FLEX_KINDS else {}
    if kind == "ncclep":  # megatron-core >= 0.19: sizes the receive buffer (generously: no overflow here)
        extra["moe_expert_rank_capacity_factor"] = float(world)
    kind = "flex" if kind in FLEX_KINDS else kind
    if overlap:
        extra["moe_shared_expert_overlap"] = True
    if capacity is not None:
        extra.update(moe_expert_capacity_factor=capacity, moe_token_drop_policy="probs")
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        expert_model_parallel_size=world,
        moe_token_dispatcher_type=kind,
        moe_router_score_function="sigmoid",
        moe_router_num_groups=GROUPS,
        moe_router_group_topk=GROUP_TOPK,
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN,
        moe_shared_expert_intermediate_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        **extra,
    )


def _swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    a, b = torch.chunk(x @ w1.t(), 2, dim=-1)
    return (torch.nn.functional.silu(a) * b) @ w2.t()


def _param_grads(layer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _check_case(world: int, kind: str, case: str, seed: int, device: torch.device) -> None:
    from moe_ep_plugin.megatron import compat

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    capacity = 0.5 if case == "capacity" else None
    config = _config(world, kind, capacity, overlap=case == "shared_overlap")
    torch.manual_seed(seed)  # identical router / shared-expert init on every rank, distinct experts below
    layer = compat.build_moe_layer(compat.local_moe_spec(EXPERTS), config).to(device)
    num_local = EXPERTS // world
    with torch.no_grad():
        for e, expert in enumerate(layer.experts.local_experts):
            g = torch.Generator().manual_seed(seed * 100 + rank * num_local + e)
            expert.linear_fc1.weight.copy_(torch.randn(expert.linear_fc1.weight.shape, generator=g) * 0.3)
            expert.linear_fc2.weight.copy_(torch.randn(expert.linear_fc2.weight.shape, generator=g) * 0.3)
        bias = torch.randn(EXPERTS, generator=gen) * 0.1
        if case == "one_expert":
            bias[EXPERTS - 1] = 100.0  # every token of every rank selects the last expert
        layer.router.expert_bias.copy_(bias.to(device))
    # Megatron's router cannot take an empty batch, so a rank with zero tokens is covered in
    # test_megatron_dispatcher.py; here the smallest batch is one token.
    tokens = {"one_token": 1 if rank == 0 else 5, "uneven": 3 + 4 * rank}.get(case, 7)
    x = torch.randn(tokens, 1, HIDDEN, generator=torch.Generator().manual_seed(seed + 17 * rank + 1)).to(device)
    grad_out = torch.randn(tokens, 1, HIDDEN, generator=torch.Generator().manual_seed(seed + 31 * rank + 2)).to(device)

    seen = {}

    def keep_routing_map(module, inputs, outputs) -> None:
        seen.setdefault("routing_map", outputs[1].detach().clone())

    layer.router.register_forward_hook(keep_routing_map)
    postprocess = layer.token_dispatcher.dispatch_postprocess

    def capture(h, p):
        out = postprocess(h, p)
        seen["tokens_per_expert"] = out[1]
        return out

    layer.token_dispatcher.dispatch_postprocess = capture

    x_plugin = x.clone().requires_grad_(True)
    out, bias_out = layer(x_plugin)
    assert bias_out is None
    out.backward(grad_out)
    plugin_grads = _param_grads(layer)
    layer.zero_grad()

    # Megatron's tokens_per_expert: its routing map summed over the EP ranks, this rank's experts.
    routing_map = seen["routing_map"]
    counts = routing_map.sum(0).to(torch.int64)
    dist.all_reduce(counts)
    expected_tpe = counts[rank * num_local : (rank + 1) * num_local].cpu()
    tpe = seen["tokens_per_expert"]
    assert tpe.dtype == torch.int64 and tpe.device.type == "cpu", (tpe.dtype, tpe.device)
    if not (kind == "ncclep" and case == "capacity"):  # 0.19.2's ncclep manager dispatches dropped (zero-prob)
        assert torch.equal(tpe, expected_tpe), (case, tpe, expected_tpe)  # pairs too: its counts include them
    if case == "one_expert":
        assert routing_map[:, EXPERTS - 1].all()
    if case == "capacity":
        dropped = torch.tensor(int((routing_map.sum(1) < TOPK).sum()), device=device)
        dist.all_reduce(dropped)
        assert int(dropped) > 0, "capacity case must drop some (token, expert) pairs"

    # Reference: gather every expert's weights, run each token through each selected expert locally.
    weights = []
    for expert in layer.experts.local_experts:
        weights.append((expert.linear_fc1.weight.detach().cpu(), expert.linear_fc2.weight.detach().cpu()))
    all_weights = [None] * world
    dist.all_gather_object(all_weights, weights)
    ref_w = [
        (w1.to(device).requires_grad_(True), w2.to(device).requires_grad_(True))
        for rank_weights in all_weights
        for w1, w2 in rank_weights
    ]
    x_ref = x.clone().requires_grad_(True)
    probs, ref_map = layer.router(x_ref)
    assert torch.equal(ref_map, routing_map)
    flat = x_ref.view(-1, HIDDEN)
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(HIDDEN, device=device)
        for e in range(EXPERTS):
            if ref_map[t, e]:
                acc = acc + probs[t, e] * _swiglu_mlp(flat[t : t + 1], *ref_w[e])[0]
        rows.append(acc)
    ref = torch.stack(rows).view_as(x) if rows else torch.zeros_like(x)
    ref = ref + layer.shared_experts(x_ref)
    ref.backward(grad_out)
    ref_grads = _param_grads(layer)

    tol = {"rtol": 1e-5, "atol": 1e-5} if device.type == "cpu" else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x_plugin.grad, x_ref.grad, **tol)
    assert set(ref_grads) == {n for n in plugin_grads if ".local_experts." not in n}
    for name, grad in ref_grads.items():  # router and shared expert: this rank's own contribution
        torch.testing.assert_close(plugin_grads[name], grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    for w1, w2 in ref_w:  # expert weights: the gradient summed over every rank's tokens
        for w in (w1, w2):
            if w.grad is None:  # no token of this rank selected the expert
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad)
    for e in range(len(layer.experts.local_experts)):
        w1, w2 = ref_w[rank * num_local + e]
        name = f"experts.local_experts.{e}.linear_fc"
        torch.testing.assert_close(plugin_grads.get(name + "1.weight", torch.zeros_like(w1)), w1.grad, **tol)
        torch.testing.assert_close(plugin_grads.get(name + "2.weight", torch.zeros_like(w2)), w2.grad, **tol)


def _suite(kinds: tuple[str, ...], cases: tuple[str, ...], seed: int, transport: str = "torch") -> None:
    from megatron.core import parallel_state as ps

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.megatron.host import seed_model_parallel_rng

    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    seed_model_parallel_rng(seed)
    ep_megatron.install(ep_megatron.PluginOptions(transport=transport))
    try:
        for kind in kinds:
            for i, case in enumerate(cases):
                if kind in FLEX_KINDS and case == "shared_overlap":
                    continue  # the overlap under test is the plugin dispatcher's; flex has its own
                _check_case(world, kind, case, seed + i, device)
    finally:
        ep_megatron.uninstall()
        ps.destroy_model_parallel()


def _served(*kinds: str) -> tuple[str, ...]:
    """``kinds`` less the flex backends the installed megatron-core lacks (ncclep needs 0.19) or cannot build
    without CUDA (hybridep on >= 0.19, :func:`support.megatron_host.flex_backends_on_host`)."""
    from moe_ep_plugin.megatron.registration import SERVED_FLEX_BACKENDS

    return tuple(
        k for k in flex_backends_on_host(kinds) if k not in ("hybridep", "ncclep") or k in SERVED_FLEX_BACKENDS
    )


@pytest.mark.parametrize(
    "world,kinds",
    [(1, ("ep_plugin",)), (2, ("ep_plugin", "flex", "hybridep", "ncclep")), (4, ("ep_plugin", "hybridep", "ncclep"))],
)
def test_moe_layer_matches_local_reference(world: int, kinds: tuple[str, ...]) -> None:
    kinds = _served(*kinds)
    cases = ("random", "uneven", "one_expert", "one_token", "capacity") if world > 1 else ("random", "capacity")
    spawn(_suite, world, args=(kinds, cases, int(time.time()) % 1000), backend="gloo", timeout_s=300)


def _have_deepepv2() -> bool:
    from moe_ep_plugin.megatron.registration import SERVED_FLEX_BACKENDS

    return "deepepv2" in SERVED_FLEX_BACKENDS


@pytest.mark.skipif(
    not _have_deepepv2(),
    reason="the installed megatron-core has no deepepv2 flex backend "
    "(Megatron-LM dev has: put a copy of its megatron/ first on PYTHONPATH, docs/compat.md)",
)
@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_flex_deepepv2(world: int) -> None:
    """Megatron-LM dev's ``flex`` + ``deepepv2`` (``_DeepepV2Manager`` on :mod:`moe_ep_plugin.megatron.deepepv2_shim`)
    equals the plain loop, and so ``alltoall``, with the ``ep_plugin`` dispatcher checked alongside."""
    cases = ("random", "uneven", "one_expert", "one_token", "capacity")
    spawn(
        _suite, world, args=(("ep_plugin", "deepepv2"), cases, int(time.time()) % 1000), backend="gloo", timeout_s=300
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_moe_layer_on_gpus() -> None:
    """The same checks on 2 GPUs (transport ``auto``: the nvlink kernels when built, else NCCL), plus the shared
    expert overlapped with dispatch on Megatron's side stream (``moe_shared_expert_overlap``)."""
    spawn(
        _suite,
        2,
        args=(("ep_plugin", "flex"), ("random", "capacity", "shared_overlap"), int(time.time()) % 1000, "auto"),
        backend="nccl",
        timeout_s=300,
    )
