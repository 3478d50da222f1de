"""Megatron-Core's own local CUDA graphs over a MoE layer whose dispatcher is ``ep_plugin`` on the ``nvlink``
transport, with drop-and-pad and dropless with a row budget (``megatron/budget.py``; one expert per rank, since
Megatron's ``SequentialMLP`` reads ``tokens_per_expert`` on the host for more): ``cuda_graph_impl: local`` with the
``moe`` region (``cuda_graph_modules``; 0.16: ``cuda_graph_scope``), which the plugin accepts on this transport
(``options.check_capture``).

Megatron graphs a ``MoETransformerLayer``: for ``moe`` its ``CudaGraphManager`` takes the whole layer's forward
(here pre-MLP norm and attention are identities, so router, dispatch, experts, combine and the residual add). A
plain ``TransformerLayer`` (what the GPT specs build, 0.16.1 and 0.19.2) makes no manager for ``moe`` and would run
eagerly. The first step runs eagerly through the manager, which records the forward and backward graphs to make;
``create_cudagraphs()`` (what Megatron's schedules call after each step) then warms up
(``cuda_graph_warmup_steps``) and captures both; later steps replay them. Each step's output, input gradient and
weight gradients equal an eager copy of the layer (same weights, same tokens) bit for bit, on several fresh
batches; the replays are counted and the dispatcher's Python code must not run during them, so an eager fallback
fails the test. The weight gradients of a replay are where Megatron puts them: ``main_grad`` (0.19: added inside
the backward graph, as for Megatron's DDP buffers), ``.grad`` (0.16).

Layouts: 2 ranks sharing ``cuda:0`` over gloo (start MPS first), and one rank per GPU over NCCL where 2 GPUs are
visible; EP 2, TP 1. ``test_config_and_layer_on_the_host`` checks without a GPU what can be: the config is
accepted (and refused on the ``torch`` transport), the layer gets a whole-layer manager, and the eager copy runs
on the ``torch`` transport. Skips naming what is missing: a GPU, the kernel library, or what megatron-core lacks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from support.gpu_marks import GPUS, NEEDS_KERNELS  # noqa: E402

from moe_ep_plugin.launch import spawn  # noqa: E402

SEQ, BATCH, HIDDEN, FFN, EXPERTS, TOPK = 32, 2, 128, 256, 8, 2
CAPACITY_FACTOR = 1.0  # capacity 16 of 64 tokens per expert: some tokens dropped, some experts padded
# Dropless with the row budget: one expert per rank, as Megatron's SequentialMLP reads tokens_per_expert on the host
# for more (megatron-core 0.16.1 and 0.19.2); every token on both experts; the budget holds every pair (EP x TOPK
# times the mean, cut to the worst case), so graphed and eager layers get the same P rows.
DROPLESS_EXPERTS, DROPLESS_TOPK = 2, 2
WARMUP_STEPS = 2
REPLAYS = 3
EP = 2


def _megatron_gap() -> str | None:
    """What the installed megatron-core lacks for Megatron's local CUDA graphs of a MoE layer, or None."""
    import megatron.core
    from megatron.core.transformer import cuda_graphs, transformer_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    needed = (
        (cuda_graphs, "CudaGraphManager"),
        (cuda_graphs, "create_cudagraphs"),
        (cuda_graphs, "delete_cuda_graphs"),
        (transformer_layer, "MoETransformerLayer"),
    )
    missing = [f"{m.__name__}.{name}" for m, name in needed if not hasattr(m, name)]
    missing += [] if "cuda_graph_impl" in fields else ["TransformerConfig.cuda_graph_impl"]
    return f"megatron-core {megatron.core.__version__} has no {', '.join(missing)}" if missing else None


NEEDS_MEGATRON_GRAPHS = pytest.mark.skipif(_megatron_gap() is not None, reason=str(_megatron_gap()))
pytestmark = NEEDS_MEGATRON_GRAPHS


def _region_key() -> str:
    """The config key naming the captured regions: ``cuda_graph_modules`` (0.19), ``cuda_graph_scope`` (0.16)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    return "cuda_graph_modules" if "cuda_graph_modules" in fields else "cuda_graph_scope"


def _config(graphed: bool, dropless: bool = False) -> Any:
    """The layer's config, BF16, drop-and-pad (``dropless``: dropless, one expert per rank); ``graphed``: Megatron's
    local graphs over the ``moe`` region. Dropout off (a captured draw is not the eager one), unfused
    bias-dropout-add."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    graphs = {"cuda_graph_impl": "local", _region_key(): ["moe"], "cuda_graph_warmup_steps": WARMUP_STEPS}
    routing = (
        dict(num_moe_experts=DROPLESS_EXPERTS, moe_router_topk=DROPLESS_TOPK)
        if dropless
        else dict(
            num_moe_experts=EXPERTS,
            moe_router_topk=TOPK,
            moe_expert_capacity_factor=CAPACITY_FACTOR,
            moe_pad_expert_input_to_capacity=True,
            moe_token_drop_policy="probs",
        )
    )
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        **routing,
        expert_model_parallel_size=EP,
        expert_tensor_parallel_size=1,
        moe_token_dispatcher_type="ep_plugin",
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
        bias_dropout_fusion=False,
        params_dtype=torch.bfloat16,
        bf16=True,
        use_cpu_initialization=True,
        **(graphs if graphed else {}),
    )


def _layer(config: Any, seed: int) -> torch.nn.Module:
    """A ``MoETransformerLayer`` of the MoE alone (no attention, identity norms), built on the host."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayerSubmodules

    from moe_ep_plugin.megatron import compat

    torch.manual_seed(seed)
    spec = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            mlp=compat.local_moe_spec(config.num_moe_experts), mlp_bda=get_bias_dropout_add
        ),
    )
    return build_module(spec, config=config, layer_number=1)


def _step(layer: torch.nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward of ``x`` ``[S, B, H]``: the output, the input's gradient and every weight gradient (the
    ``.grad`` autograd left, else ``main_grad``, where Megatron's backward graph adds it), as float32 copies."""
    for p in layer.parameters():
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
    x = x.clone().requires_grad_(True)
    out, _ = layer(hidden_states=x, attention_mask=None)
    out.backward(grad_out)
    got = {"output": out.detach().float(), "input grad": x.grad.float()}
    for name, p in layer.named_parameters():
        got[name] = (p.grad if p.grad is not None else p.main_grad).float()
    return {name: t.clone() for name, t in got.items()}


def _counted(owner: Any, name: str, counter: dict[str, int], key: str) -> None:
    """Count the calls of ``owner.name`` (an instance attribute shadowing the method) in ``counter[key]``."""
    method = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        counter[key] += 1
        return method(*args, **kwargs)

    setattr(owner, name, call)


def _plugin_options(dropless: bool, **extra: Any) -> Any:
    """The plugin options of a test layer: ``dropless`` gives the row budget that holds every pair."""
    import moe_ep_plugin.megatron as ep_megatron

    budget = {"recv_capacity_factor": float(EP * DROPLESS_TOPK)} if dropless else {}
    return ep_megatron.PluginOptions(**budget, **extra)


def _graphed_matches_eager(seed: int, shared_gpu: bool, dropless: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.transformer import cuda_graphs

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.buffer_cache import destroy_buffers
    from moe_ep_plugin.megatron.dispatcher import EPPluginTokenDispatcher

    if shared_gpu:
        torch.cuda.set_device(0)
    device = torch.device("cuda", torch.cuda.current_device())
    rank = dist.get_rank()
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=EP, expert_tensor_parallel_size=1)
    torch.manual_seed(seed)
    # CudaGraphManager takes only an RNG tracker whose generators a graph can register
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    ep_megatron.install(_plugin_options(dropless, transport="nvlink", timeout_s=60))
    try:
        graphed = _layer(_config(True, dropless), seed).to(device)
        eager = _layer(_config(False, dropless), seed).to(device)
        eager.load_state_dict(graphed.state_dict())
        for p in graphed.parameters():  # Megatron DDP's gradient buffer, which 0.19's backward graph adds into
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        dispatcher = graphed.mlp.token_dispatcher
        assert isinstance(dispatcher, EPPluginTokenDispatcher)
        assert dispatcher.budgeted if dropless else dispatcher.drop_and_pad
        calls = {"token_dispatch": 0, "fwd": 0, "bwd": 0}
        _counted(dispatcher, "token_dispatch", calls, "token_dispatch")
        gen = torch.Generator(device).manual_seed(seed * 31 + rank)
        for step in range(1 + REPLAYS):
            x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, device=device).bfloat16()
            grad_out = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, device=device).bfloat16()
            got = _step(graphed, x, grad_out)
            if step == 0:  # recorded: capture both graphs now, as Megatron's schedule does after a step
                cuda_graphs.create_cudagraphs()
                (runner,) = graphed.cudagraph_manager.cudagraph_runners
                assert runner.fwd_graph is not None and runner.bwd_graph is not None, "no graph was captured"
                _counted(runner.fwd_graph, "replay", calls, "fwd")
                _counted(runner.bwd_graph, "replay", calls, "bwd")
                traced = calls["token_dispatch"]
            want = _step(eager, x, grad_out)
            assert got.keys() == want.keys(), (sorted(got), sorted(want))
            for name, expected in want.items():
                diff = float((got[name] - expected).abs().max())
                assert torch.equal(got[name], expected), f"rank {rank} step {step}: {name} differs by {diff:g}"
        torch.cuda.synchronize(device)
        assert calls["fwd"] == calls["bwd"] == REPLAYS, f"rank {rank}: replays {calls}, expected {REPLAYS} each"
        assert calls["token_dispatch"] == traced, f"rank {rank}: the dispatcher ran eagerly during a replay"
        dispatcher.check_over_budget()  # the budget held every pair, replays included
        dist.barrier()
        if rank == 0:
            kind = "dropless (row budget)" if dropless else "drop-and-pad"
            print(f"ok Megatron's local graph of the ep_plugin {kind} layer: {REPLAYS} replays equal eager", flush=True)
    finally:
        cuda_graphs.delete_cuda_graphs()
        ep_megatron.uninstall()
        destroy_buffers()
        ps.destroy_model_parallel()


LAYOUTS = [
    pytest.param(True, "gloo", marks=NEEDS_KERNELS, id="2-ranks-sharing-cuda0"),
    pytest.param(
        False,
        "nccl",
        marks=[*NEEDS_KERNELS, pytest.mark.skipif(GPUS < EP, reason=f"needs {EP} CUDA GPUs, {GPUS} visible")],
        id="one-rank-per-gpu",
    ),
]


@pytest.mark.parametrize("dropless", [False, True], ids=["drop-and-pad", "dropless"])
@pytest.mark.parametrize("shared_gpu,backend", LAYOUTS)
def test_megatron_graphed_layer_equals_eager(shared_gpu: bool, backend: str, dropless: bool) -> None:
    """EP 2 ranks, the plugin's Buffer on the ``nvlink`` kernels: sharing ``cuda:0`` over gloo, or one per GPU."""
    seed = int(time.time()) % 1000
    spawn(_graphed_matches_eager, EP, args=(seed, shared_gpu, dropless), backend=backend, timeout_s=600)


class _ManagerProbe:
    """Stands in for ``CudaGraphManager`` (whose constructor needs CUDA): records the function each manager would
    graph (None: the whole layer)."""

    made: list[str | None] = []  # one list per process: each rank runs the check once

    def __init__(self, config: Any, base_module: Any = None, function_name: str | None = None, **_: Any) -> None:
        _ManagerProbe.made.append(function_name)


def _host_checks(seed: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import cuda_graphs

    import moe_ep_plugin.megatron as ep_megatron
    from moe_ep_plugin.buffer_cache import destroy_buffers
    from moe_ep_plugin.megatron.dispatcher import EPPluginTokenDispatcher
    from moe_ep_plugin.megatron.host import seed_model_parallel_rng

    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=EP, expert_tensor_parallel_size=1)
    seed_model_parallel_rng(seed)
    manager = cuda_graphs.CudaGraphManager
    try:
        ep_megatron.install(ep_megatron.PluginOptions(transport="nvlink"))
        config = _config(True)
        assert [getattr(r, "name", r) for r in getattr(config, _region_key())] == ["moe"]
        cuda_graphs.CudaGraphManager = _ManagerProbe
        layer = _layer(config, seed)
        assert _ManagerProbe.made == [None], f"expected one whole-layer graph manager, got {_ManagerProbe.made}"
        assert isinstance(layer.mlp.token_dispatcher, EPPluginTokenDispatcher)
        ep_megatron.install(_plugin_options(True, transport="nvlink"))
        assert _layer(_config(True, True), seed).mlp.token_dispatcher.budgeted  # dropless: the row budget
        ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
        for dropless in (False, True):  # the torch transport reads counts on the host: no graph may hold its dispatch
            with pytest.raises(ValueError, match=_region_key()):
                _config(True, dropless)
        eager = _layer(_config(False), seed)
        x = torch.randn(SEQ, BATCH, HIDDEN).bfloat16()
        got = _step(eager, x, torch.randn(SEQ, BATCH, HIDDEN).bfloat16())
        assert got["output"].shape == (SEQ, BATCH, HIDDEN) and all(t.isfinite().all() for t in got.values())
    finally:
        cuda_graphs.CudaGraphManager = manager
        ep_megatron.uninstall()
        destroy_buffers()
        ps.destroy_model_parallel()


@pytest.mark.skipif(GPUS > 0, reason="with a GPU visible Megatron places the router on it; the GPU tests run this")
def test_config_and_layer_on_the_host() -> None:
    """Without a GPU: the graphed config is accepted on ``nvlink`` and refused on ``torch``, the layer gets one
    whole-layer manager and the plugin's dispatcher, and its eager copy runs a step on the ``torch`` transport."""
    spawn(_host_checks, EP, args=(int(time.time()) % 1000,), backend="gloo", timeout_s=300)
