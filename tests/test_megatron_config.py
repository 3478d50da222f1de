"""Registration (install/uninstall), plugin options and the YAML → ``TransformerConfig`` mapping; no processes."""

from __future__ import annotations

import copy
import os
import types

import pytest
import torch
import yaml

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from megatron.core.transformer import transformer_config as tc  # noqa: E402
from megatron.core.transformer.moe import fused_a2a, moe_layer, token_dispatcher  # noqa: E402

import moe_ep_plugin.megatron as ep_megatron  # noqa: E402
from moe_ep_plugin.megatron import deepep_shim, registration  # noqa: E402
from moe_ep_plugin.recipes.megatron.yaml_config import load_pretrain_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [os.path.join(ROOT, "configs", name) for name in ("megatron_dsv3_cpu.yaml", "megatron_dsv3_ep2.yaml")]


@pytest.fixture(autouse=True)
def _restore_megatron():
    ep_megatron.uninstall()  # reading a YAML elsewhere in this process installs the plugin
    yield
    ep_megatron.uninstall()


def _originals():
    return (
        moe_layer.MoELayer.__init__,
        tc.TransformerConfig.__post_init__,
        token_dispatcher.fused_dispatch,
        token_dispatcher.fused_combine,
        token_dispatcher.set_deepep_num_sms,
        fused_a2a.fused_dispatch,
        registration._free_input_module().should_free_input,
    )


def _moe_config(**kw):
    base = dict(
        num_layers=1,
        hidden_size=128,
        num_attention_heads=2,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_token_dispatcher_type="ep_plugin",
        use_cpu_initialization=True,
    )
    base.update(kw)
    return tc.TransformerConfig(**base)


def test_install_is_idempotent_and_reversible() -> None:
    before = _originals()
    assert not ep_megatron.is_installed()
    ep_megatron.install()
    once = _originals()
    ep_megatron.install(ep_megatron.PluginOptions(fp8_dispatch=True))
    assert _originals() == once and ep_megatron.is_installed()
    assert token_dispatcher.fused_dispatch is deepep_shim.fused_dispatch
    assert fused_a2a.fused_combine is deepep_shim.fused_combine
    assert deepep_shim.current_options().fp8_dispatch  # the second call only updated the options
    ep_megatron.uninstall()
    assert _originals() == before and not ep_megatron.is_installed()
    assert not deepep_shim.current_options().fp8_dispatch
    ep_megatron.uninstall()
    assert _originals() == before
    ep_megatron.install()
    assert ep_megatron.is_installed()


def test_config_validation_after_install() -> None:
    # Megatron itself refuses shared-expert overlap for an unknown dispatcher type ...
    with pytest.raises(ValueError, match="moe_shared_expert_overlap"):
        _moe_config(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
    ep_megatron.install()
    # ... the plugin has it, so after install() the config is accepted and carries the default options.
    config = _moe_config(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
    assert config.moe_token_dispatcher_type == "ep_plugin"
    assert ep_megatron.get_plugin_options(config) == ep_megatron.PluginOptions()
    # Expert TP, drop-and-pad and the EP-overlap schedule are served (tests/test_megatron_parity.py,
    # tests/test_megatron_overlap.py).
    assert (
        _moe_config(
            expert_tensor_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True, add_bias_linear=False
        ).expert_tensor_parallel_size
        == 2
    )
    assert _moe_config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    overlap = dict(overlap_moe_expert_parallel_comm=True, bf16=True, expert_model_parallel_size=2)
    assert _moe_config(**overlap).overlap_moe_expert_parallel_comm
    # Megatron's other checks of the overlap flag still hold for ep_plugin.
    for extra, match in (
        ({"expert_model_parallel_size": 1}, "only supported with expert model parallelism"),
        ({"bf16": False}, "only supported with bf16 or fp16"),
        (
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
            "disable full recomputation",
        ),
        (
            {"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_overlap": True},
            "disable moe_shared_expert_overlap",
        ),
    ):
        with pytest.raises(AssertionError, match=match):
            _moe_config(**{**overlap, **extra})
    # FP16: every transport serves it (rows as they are, as BF16's); FP8 dispatch, which quantizes BF16 rows, is
    # refused when the config is made or given the options.
    fp16 = _moe_config(fp16=True)
    for transport in ("torch", "nvlink", "hierarchical", "auto"):
        ep_megatron.set_plugin_options(fp16, ep_megatron.PluginOptions(transport=transport))
    with pytest.raises(ValueError, match="fp16: True with ep_plugin.fp8_dispatch"):
        ep_megatron.set_plugin_options(fp16, ep_megatron.PluginOptions(transport="nvlink", fp8_dispatch=True))
    ep_megatron.install(ep_megatron.PluginOptions(transport="nvlink"))
    assert _moe_config(fp16=True).fp16
    ep_megatron.install(ep_megatron.PluginOptions(transport="nvlink", fp8_dispatch=True))
    with pytest.raises(ValueError, match="fp16: True with ep_plugin.fp8_dispatch"):
        _moe_config(fp16=True, hidden_size=128)
    ep_megatron.install(ep_megatron.PluginOptions(fp8_dispatch=True))
    with pytest.raises(ValueError, match="multiple of 128"):
        _moe_config(hidden_size=96)
    ep_megatron.set_plugin_options(config, ep_megatron.PluginOptions(transport="torch", num_sms=8))
    assert ep_megatron.get_plugin_options(config).num_sms == 8
    with pytest.raises(TypeError, match="PluginOptions"):
        ep_megatron.set_plugin_options(config, {"transport": "torch"})


def test_cuda_graphs_that_capture_the_dispatch_are_refused_at_config_time() -> None:
    """ep_plugin on the nvlink transport (local in a group of one rank) reads nothing on the host, dropless (the
    device-side row budget) or drop-and-pad; every other dispatch of this library reads its counts once. So a
    CUDA-graph region holding the dispatch (the whole layer, ``moe``, a full iteration) is accepted there, Megatron's
    "only supported with drop-padding MoE" assertion lifted for exactly that case, and refused when the config is
    built otherwise, for ep_plugin and the flex backends alike; the regions before the dispatch (attention, router,
    preprocess) are accepted everywhere, and alltoall keeps Megatron's own rule."""
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    # megatron-core 0.16 names the regions cuda_graph_scope, 0.19 cuda_graph_modules
    key = (
        "cuda_graph_modules"
        if "cuda_graph_modules" in tc.TransformerConfig.__dataclass_fields__
        else "cuda_graph_scope"
    )
    flex = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", expert_model_parallel_size=2)
    pad = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    for kind, who in (
        (dict(moe_token_dispatcher_type="ep_plugin"), "ep_plugin on transport 'torch'"),
        (flex, "'deepep'"),
    ):
        for regions in ("attn", "moe_router", "moe_preprocess", "attn,moe_router"):
            _moe_config(**kind, cuda_graph_impl="local", **{key: regions})
        _moe_config(**kind, cuda_graph_impl="transformer_engine", **{key: "attn"})
        _moe_config(**kind)  # no graphs
        with pytest.raises(
            ValueError,
            match=rf"{key}: the whole layer with cuda_graph_impl 'local' captures the "
            rf"MoE token dispatch, which .*{who} runs with one host read",
        ):
            _moe_config(**kind, cuda_graph_impl="local", **{key: []})
    for extra in (pad, {}):
        with pytest.raises(
            ValueError,
            match=rf"{key}: \['moe'\] with cuda_graph_impl 'local' captures .* or set ep_plugin.transport: nvlink",
        ):
            _moe_config(cuda_graph_impl="local", **{key: "moe"}, **extra, expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="use moe_flex_dispatcher_backend: hybridep or ncclep with a static budget"):
        _moe_config(**flex, cuda_graph_impl="local", **{key: []})
    _moe_config(moe_token_dispatcher_type="alltoall", cuda_graph_impl="local", **{key: "moe"}, **pad)
    with pytest.raises(AssertionError, match="only supported with drop-padding MoE"):  # Megatron's, for alltoall
        _moe_config(moe_token_dispatcher_type="alltoall", cuda_graph_impl="local", **{key: "moe"})
    for transport in ("nvlink", "local"):
        ep_megatron.install(ep_megatron.PluginOptions(transport=transport))
        for regions, ep, extra in (
            ("moe", 2, pad),
            ([], 2, pad),
            ("moe", 1, pad),
            ("moe", 2, {}),  # dropless: the worst-case row budget
            ([], 2, {}),
            ("moe,attn", 1, {}),
        ):
            config = _moe_config(cuda_graph_impl="local", **{key: regions}, **extra, expert_model_parallel_size=ep)
            assert sorted(region.name for region in getattr(config, key)) == sorted(
                name for name in (regions.split(",") if regions else [])
            )
        with pytest.raises(AssertionError, match="must not contain both moe and moe_router"):  # Megatron's rules
            _moe_config(cuda_graph_impl="local", **{key: "moe,moe_router"})
        with pytest.raises(AssertionError, match="hidden dropout is not supported with graphed MLP/MoE"):
            _moe_config(
                cuda_graph_impl="local",
                **{key: "moe"},
                recompute_granularity="selective",
                recompute_modules=["moe"],
                hidden_dropout=0.1,
            )
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    # a whole iteration: an implementation of its own from 0.19, a region before
    whole, named = (
        (dict(cuda_graph_impl="full_iteration"), "cuda_graph_impl: 'full_iteration'")
        if key == "cuda_graph_modules"
        else (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"), r"\['full_iteration'\]")
    )
    with pytest.raises(ValueError, match=rf"{named}.* captures the MoE token dispatch"):
        _moe_config(**whole)
    config = _moe_config(cuda_graph_impl="local", **{key: "attn"})  # options given later are checked alike
    config.cuda_graph_impl = "local"
    setattr(config, key, [])
    with pytest.raises(ValueError, match="captures the MoE token dispatch"):
        ep_megatron.set_plugin_options(config, ep_megatron.PluginOptions(transport="torch"))
    ep_megatron.set_plugin_options(config, ep_megatron.PluginOptions(transport="nvlink"))


def test_flex_cuda_graphs_accepted_where_the_shim_reads_nothing() -> None:
    """A CUDA-graph region holding the ``flex`` dispatch is accepted for the shims' device-sized forms on
    ``nvlink``/``local`` when Megatron's own call reads nothing either: ``hybridep`` with a static row budget
    (drop-and-pad; 0.19's ``moe_expert_rank_capacity_factor``) and ``ncclep`` with ``moe_ncclep_static_shape``
    (0.19); every other case is refused at config time naming the key to set."""
    key = (
        "cuda_graph_modules"
        if "cuda_graph_modules" in tc.TransformerConfig.__dataclass_fields__
        else "cuda_graph_scope"
    )
    fields = tc.TransformerConfig.__dataclass_fields__
    rank_budget = "moe_expert_rank_capacity_factor" in fields  # 0.19
    pad = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    hybridep = dict(
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", expert_model_parallel_size=2
    )
    whole = (
        dict(cuda_graph_impl="full_iteration")
        if key == "cuda_graph_modules"
        else dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration")
    )
    graphs = [dict(cuda_graph_impl="local", **{key: "moe"}), dict(cuda_graph_impl="local", **{key: []}), whole]
    for transport in ("nvlink", "local"):
        ep_megatron.install(ep_megatron.PluginOptions(transport=transport))
        for graph in graphs:
            _moe_config(**hybridep, **pad, **graph)
            if rank_budget:
                # 0.19 asks for TransformerEngine's op fuser with this budget (a flag at config time)
                _moe_config(
                    **hybridep, moe_expert_rank_capacity_factor=1.5, use_transformer_engine_op_fuser=True, **graph
                )
            with pytest.raises(ValueError, match="captures the MoE token dispatch.*'hybridep'.*set moe_pad_expert"):
                _moe_config(**hybridep, **graph)  # dropless without a budget: the counts come back to the host
            with pytest.raises(ValueError, match="'deepep'.*hybridep or ncclep with a static budget"):
                _moe_config(**{**hybridep, "moe_flex_dispatcher_backend": "deepep"}, **pad, **graph)
        if "moe_hybridep_pad_uneven_dispatch_inputs" in fields:
            with pytest.raises(ValueError, match="unset moe_hybridep_pad_uneven_dispatch_inputs"):
                _moe_config(**hybridep, **pad, **graphs[1], moe_hybridep_pad_uneven_dispatch_inputs=True)
        if "ncclep" in registration.SERVED_FLEX_BACKENDS:
            ncclep = {**hybridep, "moe_flex_dispatcher_backend": "ncclep", "moe_expert_rank_capacity_factor": 1.5}
            _moe_config(**ncclep, moe_ncclep_static_shape=True, **graphs[1])
            with pytest.raises(ValueError, match="'ncclep'.*set moe_ncclep_static_shape: true"):
                _moe_config(**ncclep, **graphs[1])
    ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
    with pytest.raises(ValueError, match="'hybridep'.*set ep_plugin.transport: nvlink"):
        _moe_config(**hybridep, **pad, **graphs[1])
    _moe_config(**hybridep, cuda_graph_impl="local", **{key: "attn"})  # before the dispatch: any backend


def test_deepepv2_cuda_graphs_refused_naming_the_fix(monkeypatch) -> None:
    """A CUDA-graph region holding the ``flex`` + ``deepepv2`` dispatch is refused at config time on every transport,
    naming the backends and keys that capture: Megatron-LM dev's ``_DeepepV2Manager`` reads the count on the host
    after the dispatch (the ``deepep`` manager's permute), whatever the shim's ``do_cpu_sync``. The installed
    megatron-core may lack ``deepepv2`` (``_check_flex`` then names the backend), so the check runs as Megatron-LM
    dev's ``__post_init__`` would call it, on a config holding the fields it reads."""
    monkeypatch.setattr(registration, "SERVED_FLEX_BACKENDS", (*registration.SERVED_FLEX_BACKENDS, "deepepv2"))

    def config(**graph):
        return types.SimpleNamespace(num_moe_experts=8, moe_flex_dispatcher_backend="deepepv2", **graph)

    for transport in ("nvlink", "local", "torch"):
        options = ep_megatron.PluginOptions(transport=transport)
        for graph in ({"cuda_graph_scope": "moe"}, {"cuda_graph_scope": []}, {"cuda_graph_scope": "full_iteration"}):
            with pytest.raises(
                ValueError,
                match=r"captures the MoE token dispatch, which moe_flex_dispatcher_backend 'deepepv2' .*"
                r"use moe_flex_dispatcher_backend: hybridep or ncclep with a static budget, or "
                r"moe_token_dispatcher_type: ep_plugin",
            ):
                registration._check_flex_capture(config(cuda_graph_impl="local", **graph), options)
        # a region before the dispatch, or no graph: nothing captured, nothing refused
        assert not registration._check_flex_capture(config(cuda_graph_impl="local", cuda_graph_scope="attn"), options)
        assert not registration._check_flex_capture(config(cuda_graph_impl="none", cuda_graph_scope=[]), options)


def test_row_budget_keys() -> None:
    """``recv_capacity_factor`` and ``drop_on_overflow`` are validated, the drop needs a factor, drop-and-pad and
    the flex backends refuse them naming the key."""
    with pytest.raises(ValueError, match="recv_capacity_factor: expected a positive number"):
        ep_megatron.PluginOptions(recv_capacity_factor=0)
    with pytest.raises(ValueError, match="recv_capacity_factor"):
        ep_megatron.PluginOptions(recv_capacity_factor=True)
    with pytest.raises(TypeError, match="drop_on_overflow"):
        ep_megatron.PluginOptions(recv_capacity_factor=1.5, drop_on_overflow=1)
    with pytest.raises(ValueError, match="drop_on_overflow: only with recv_capacity_factor"):
        ep_megatron.PluginOptions(drop_on_overflow=True)
    budget = ep_megatron.PluginOptions(recv_capacity_factor=1.5, drop_on_overflow=True)
    ep_megatron.install(budget)
    _moe_config()
    with pytest.raises(ValueError, match="ep_plugin.recv_capacity_factor: drop-and-pad"):
        _moe_config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    from megatron.core.transformer.enums import AttnBackend

    invariant = dict(batch_invariant_mode=True, attention_backend=AttnBackend.flash, attention_dropout=0.0)
    if "flash_attention_version" in tc.TransformerConfig.__dataclass_fields__:  # 0.19 asks for FlashAttention 3/4
        invariant["flash_attention_version"] = 3
    with pytest.raises(ValueError, match="ep_plugin.recv_capacity_factor: batch_invariant_mode"):
        _moe_config(**invariant)
    flex = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="ep_plugin.recv_capacity_factor: the row budget of"):
        _moe_config(**flex)
    ep_megatron.install()
    with pytest.raises(ValueError, match="ep_plugin.recv_capacity_factor: the row budget of"):  # options given later
        ep_megatron.set_plugin_options(_moe_config(**flex), budget)


@pytest.mark.skipif(
    "moe_expert_rank_capacity_factor" not in tc.TransformerConfig.__dataclass_fields__,
    reason="megatron-core 0.16 has no moe_expert_rank_capacity_factor",
)
def test_megatron_rank_capacity_factor_is_ep_plugins_budget() -> None:
    """Where Megatron has ``moe_expert_rank_capacity_factor`` (0.19: refused for every dispatcher but flex
    ``hybridep``/``ncclep``), ``ep_plugin`` takes it as its row budget, one that drops as Megatron's backends do;
    ``ep_plugin.recv_capacity_factor`` beside it, drop-and-pad or a bad value are refused naming the key."""
    from moe_ep_plugin.megatron import options

    key = "moe_expert_rank_capacity_factor"
    ep_megatron.install()
    config = _moe_config(**{key: 2.0})
    assert getattr(config, key) == 2.0
    assert options.row_budget(config, ep_megatron.get_plugin_options(config)) == (key, 2.0, True)
    with pytest.raises(ValueError, match=rf"{key}: expected a positive number"):
        _moe_config(**{key: -1.0})
    with pytest.raises(ValueError, match=rf"{key}: drop-and-pad"):
        _moe_config(**{key: 2.0}, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError, match="requires moe_flex_dispatcher_backend"):  # Megatron's, for alltoall
        _moe_config(moe_token_dispatcher_type="alltoall", **{key: 2.0})
    ep_megatron.install(ep_megatron.PluginOptions(recv_capacity_factor=1.5))
    with pytest.raises(ValueError, match=rf"ep_plugin.recv_capacity_factor: {key} gives ep_plugin's row budget"):
        _moe_config(**{key: 2.0})


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"transport": "nccl"}, ValueError, "transport"),
        ({"fp8_dispatch": 1}, TypeError, "fp8_dispatch"),
        ({"num_sms": 7}, ValueError, "num_sms"),
        ({"num_sms": True}, TypeError, "num_sms"),
        ({"timeout_s": 0}, ValueError, "timeout_s"),
        ({"transport": "torch", "ranks_per_node": 2}, ValueError, "ranks_per_node: only for transport 'hierarchical'"),
        ({"transport": "nvlink", "ranks_per_node": 1}, ValueError, "ranks_per_node: only for transport 'hierarchical'"),
    ],
)
def test_plugin_options_are_validated(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        ep_megatron.PluginOptions(**kwargs)


def test_shipped_configs_map_to_transformer_config() -> None:
    cpu, gpu = (load_pretrain_config(path) for path in CONFIGS)
    for cfg in (cpu, gpu):
        t = cfg.transformer
        assert isinstance(t, tc.TransformerConfig) and t.moe_token_dispatcher_type == "ep_plugin"
        assert (t.moe_router_score_function, t.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
        assert t.moe_router_enable_expert_bias and t.gated_linear_unit and t.activation_func is torch.nn.functional.silu
        assert t.moe_layer_freq[0] == 0 and t.moe_shared_expert_intermediate_size > 0
        assert t.expert_model_parallel_size == cfg.parallel["expert_model_parallel_size"] == 2
        assert ep_megatron.get_plugin_options(t) == cfg.plugin
    assert cpu.transformer.params_dtype == torch.float32 and not cpu.transformer.bf16
    assert gpu.transformer.params_dtype == torch.bfloat16 and gpu.transformer.bf16
    assert gpu.plugin == ep_megatron.PluginOptions(transport="auto", fp8_dispatch=True, num_sms=24)
    assert (gpu.transformer.moe_router_num_groups, gpu.transformer.moe_router_group_topk) == (8, 4)
    assert gpu.train.steps == 100 and gpu.train.lr == 1e-3


def _raw() -> dict:
    with open(CONFIGS[0], encoding="utf-8") as f:
        return yaml.safe_load(f)


def _edit(section: str, **values) -> dict:
    raw = copy.deepcopy(_raw())
    raw.setdefault(section, {}).update(values)
    return raw


@pytest.mark.parametrize(
    "raw,error,match",
    [
        ({**_raw(), "optimizer": {}}, ValueError, r"optimizer: unknown section"),
        (_edit("model", moe_router_topk_typo=3), ValueError, r"model: unknown key\(s\) \['moe_router_topk_typo'\]"),
        (_edit("ep_plugin", sms=3), ValueError, r"ep_plugin.sms: unknown option"),
        (_edit("train", step=3), ValueError, r"train.step: unknown key"),
        (_edit("parallel", data_parallel_size=2), ValueError, r"parallel: unknown key"),
        (_edit("model", expert_model_parallel_size=2), ValueError, "belong in the parallel: section"),
        (_edit("model", moe_token_dispatcher_type="alltoall"), ValueError, "ep_plugin: options given"),
        (
            _edit("model", moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepepv2"),
            ValueError,
            "moe_flex_dispatcher_backend",
        ),
        (_edit("model", moe_deepep_num_sms=20) | {"ep_plugin": {"num_sms": 24}}, ValueError, "conflicts"),
        (_edit("model", gated_linear_unit=True), ValueError, "activation or gated_linear_unit"),
        (_edit("model", bf16=True), ValueError, "dtype or bf16"),
        (_edit("model", activation="relu2"), ValueError, "model.activation"),
        (_edit("model", dtype="fp8"), ValueError, "model.dtype"),
        (_edit("model", num_layers="3"), ValueError, "model.num_layers: expected int"),
        (_edit("model", add_bias_linear="no"), ValueError, "model.add_bias_linear: expected bool"),
        (_edit("model", hidden_size=96) | {"ep_plugin": {"fp8_dispatch": True}}, ValueError, "multiple of 128"),
        (_edit("ep_plugin", transport="ib"), ValueError, "ep_plugin.transport"),
        (_edit("train", global_batch_size=6), ValueError, "global_batch_size"),
        (_edit("train", seq_length=128), ValueError, "max_sequence_length"),
        (_edit("data", eval_fraction=1.0), ValueError, "eval_fraction"),
        (_edit("model", activation_func="silu"), ValueError, "not expressible"),
        (_edit("model", cuda_graph_impl="local"), ValueError, "model.cuda_graph_impl: 'local' is not served"),
        (_edit("model", enable_cuda_graph=True), ValueError, "model.enable_cuda_graph: not served"),
    ],
)
def test_yaml_errors_name_the_key(raw, error, match) -> None:
    with pytest.raises(error, match=match):
        load_pretrain_config(raw)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_yaml_flex_backends_are_served_and_number_spellings(backend: str) -> None:
    raw = _raw()
    raw["model"].update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
    raw["train"]["lr"] = "3e-4"  # PyYAML reads this spelling as a string
    cfg = load_pretrain_config(raw)
    assert cfg.transformer.moe_token_dispatcher_type == "flex" and cfg.train.lr == 3e-4
    assert ep_megatron.is_installed() and token_dispatcher.fused_dispatch is deepep_shim.fused_dispatch
    assert deepep_shim.current_options() == cfg.plugin
