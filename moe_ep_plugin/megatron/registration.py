"""Register the plugin with Megatron-Core without editing it: ``install()`` / ``uninstall()``.

After :func:`install`:

- ``moe_token_dispatcher_type: ep_plugin`` (YAML or ``TransformerConfig``) makes ``MoELayer`` build
  :class:`EPPluginTokenDispatcher`. ``MoELayer.__init__`` chooses its dispatcher by comparing the type string
  with its three built-in names, so the wrapper runs the original ``__init__`` with the type shown as ``flex``
  and the name ``MoEFlexTokenDispatcher`` bound to the plugin dispatcher, restoring both before returning.
  ``TransformerConfig.__post_init__`` validates an ``ep_plugin`` config the way it validates ``alltoall``
  (the built-in dispatcher whose features — shared-expert overlap, capacity dropping — the plugin has), then
  checks the plugin's own options; ``batch_invariant_mode`` is accepted for dropless routing
  (:func:`_check_batch_invariant`).
- ``moe_token_dispatcher_type: flex`` + ``moe_flex_dispatcher_backend: deepep``, ``hybridep``, ``ncclep`` or
  ``deepepv2`` runs on this library's Buffer: ``fused_dispatch``/``fused_combine``/``set_deepep_num_sms``
  (``deepep_shim``) and ``hybrid_ep_dispatch``/``hybrid_ep_combine`` (``hybridep_shim``), on megatron-core >= 0.19
  the ``ncclep`` functions (``ncclep_shim``), and on Megatron-LM dev (which has ``deepepv2``)
  ``get_elastic_buffer``/``deepepv2_dispatch``/``deepepv2_combine`` (``deepepv2_shim``) are rebound in
  ``token_dispatcher`` and ``fused_a2a`` (Megatron reads them at call time). A ``flex`` config naming another
  backend, or plugin options
  its shape cannot take, fails in ``TransformerConfig.__post_init__`` naming the key.
- ``overlap_moe_expert_parallel_comm`` (Megatron's 1F1B EP-overlap schedule): ``should_free_input`` keeps the
  ``moe_dispatch`` and ``mlp`` nodes' inputs for ``ep_plugin``, as Megatron keeps them for ``hybridep``
  (:func:`_wrap_should_free_input`).

Both steps are idempotent; :func:`uninstall` restores every original object.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import megatron.core
from megatron.core.transformer import transformer_config as tc_module
from megatron.core.transformer.moe import fused_a2a, moe_layer, token_dispatcher

from . import deepep_shim, deepepv2_shim, hybridep_shim, ncclep_shim
from .dispatcher import EPPluginTokenDispatcher
from .options import (
    MEGATRON_BUDGET_KEY,
    PLUGIN_DISPATCHER_TYPE,
    SYNC_FREE_TRANSPORTS,
    PluginOptions,
    captured_dispatch,
    check_budget,
    check_capture,
    check_fp16,
    get_plugin_options,
    graph_regions,
    set_plugin_options,
)

SUPPORTED_MCORE = ("0.16", "0.17", "0.18", "0.19", "0.20")
# (shim module, names Megatron's managers read from token_dispatcher / fused_a2a at call time)
_NCCLEP_NAMES = (
    "ensure_nccl_ep_bootstrapped",
    "new_nccl_ep_buffer",
    "nccl_ep_dispatch",
    "nccl_ep_combine",
    "alloc_ep_symm_buffer",
    "nccl_ep_finalize",
    "is_nccl_ep_bootstrapped",
)  # the last: main only
_DEEPEPV2_NAMES = ("get_elastic_buffer", "deepepv2_dispatch", "deepepv2_combine")
_HAVE_NCCLEP = hasattr(fused_a2a, "nccl_ep_dispatch")  # megatron-core >= 0.19
# Megatron-LM dev: the names exist (None without DeepEP V2) wherever the deepepv2 backend does
_HAVE_DEEPEPV2 = hasattr(fused_a2a, "deepepv2_dispatch")
_SHIMS = (
    (
        (deepep_shim, ("fused_dispatch", "fused_combine", "set_deepep_num_sms")),
        (hybridep_shim, ("hybrid_ep_dispatch", "hybrid_ep_combine")),
    )
    + (((ncclep_shim, _NCCLEP_NAMES),) if _HAVE_NCCLEP else ())
    + (((deepepv2_shim, _DEEPEPV2_NAMES),) if _HAVE_DEEPEPV2 else ())
)
# the flex backends install() serves on this megatron-core (ncclep, deepepv2 where the installed version has them)
SERVED_FLEX_BACKENDS = (
    ("deepep", "hybridep") + (("ncclep",) if _HAVE_NCCLEP else ()) + (("deepepv2",) if _HAVE_DEEPEPV2 else ())
)
# Where Megatron's 1F1B EP-overlap schedule decides which node inputs it frees after forward (0.19: the common
# schedule utilities; 0.16: the GPT fine-grained callables).
_FREE_INPUT_MODULES = ("megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables")
_originals: dict[tuple[Any, str], Any] = {}
_default_options = PluginOptions()


def _check_version() -> None:
    version = getattr(megatron.core, "__version__", "unknown")
    if not version.startswith(SUPPORTED_MCORE):
        raise RuntimeError(
            f"moe_ep_plugin.megatron supports megatron-core {', '.join(SUPPORTED_MCORE)}.x; found {version}"
        )
    for module, name in (
        (moe_layer, "MoEFlexTokenDispatcher"),
        (token_dispatcher, "_DeepepManager"),
        (token_dispatcher, "fused_dispatch"),
        (fused_a2a, "fused_combine"),
    ):
        if not hasattr(module, name):
            raise RuntimeError(
                f"megatron-core {version}: {module.__name__}.{name} is missing; this layout is not supported"
            )


def _patch(owner: Any, name: str, value: Any) -> None:
    key = (owner, name)
    if key not in _originals:
        _originals[key] = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)


@contextlib.contextmanager
def _dispatcher_type_shown_as(config: Any, shown: str) -> Iterator[None]:
    config.moe_token_dispatcher_type = shown
    try:
        yield
    finally:
        config.moe_token_dispatcher_type = PLUGIN_DISPATCHER_TYPE


def _wrap_moe_layer_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs["config"] if "config" in kwargs else args[0]
        if config.moe_token_dispatcher_type != PLUGIN_DISPATCHER_TYPE:
            return original(self, *args, **kwargs)
        factory = functools.partial(EPPluginTokenDispatcher, options=get_plugin_options(config, _default_options))
        flex = moe_layer.MoEFlexTokenDispatcher
        moe_layer.MoEFlexTokenDispatcher = factory
        try:
            with _dispatcher_type_shown_as(config, "flex"):
                original(self, *args, **kwargs)
        finally:
            moe_layer.MoEFlexTokenDispatcher = flex

    __init__._moe_ep_plugin = True
    return __init__


def _wrap_post_init(original: Any) -> Any:
    @functools.wraps(original)
    def __post_init__(self) -> None:
        if getattr(self, "moe_token_dispatcher_type", None) == "flex":
            options = get_plugin_options(self, _default_options)
            # before Megatron's drop-padding assertion, whose message names no fix
            captured = _check_flex_capture(self, options)
            with _moe_region_hidden(self, options) if captured else contextlib.nullcontext():
                original(self)
            return _check_flex(self)
        if getattr(self, "moe_token_dispatcher_type", None) != PLUGIN_DISPATCHER_TYPE:
            return original(self)
        options = get_plugin_options(self, _default_options)
        check_capture(self, options)  # before Megatron's drop-padding assertion, whose message names no fix
        with (
            _dispatcher_type_shown_as(self, "alltoall"),
            _moe_region_hidden(self, options),
            _megatron_budget_hidden(self),
        ):
            original(self)
        set_plugin_options(self, options)  # validates the options against this config (FP8, FP16, budget, capture)
        _check_batch_invariant(self)

    __post_init__._moe_ep_plugin = True
    return __post_init__


@contextlib.contextmanager
def _moe_region_hidden(config: Any, options: PluginOptions) -> Iterator[None]:
    """Megatron asserts "moe cuda graph is only supported with drop-padding MoE" because ``alltoall``'s dropless
    shapes depend on counts read on the host. ``ep_plugin`` on a transport that reads nothing
    (``SYNC_FREE_TRANSPORTS``) runs dropless with a device-side row budget (``budget.py``), so exactly that
    assertion is lifted for it: while Megatron's checks run, its module's region enum (0.16 ``CudaGraphScope`` of
    ``cuda_graph_scope``, 0.19 ``CudaGraphModule`` of ``cuda_graph_modules``) answers ``moe`` with a member no
    region list holds (every other name, lookup and isinstance check as the real enum), and the other checks of the
    ``moe`` region this skips are made here afterwards with Megatron's messages (``_check_moe_region``). Every
    other config sees Megatron's checks unchanged."""
    key = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
    name = "CudaGraphModule" if key == "cuda_graph_modules" else "CudaGraphScope"
    real = getattr(tc_module, name, None)
    if (
        real is None
        or getattr(config, "cuda_graph_impl", "none") in ("none", "full_iteration")
        or getattr(config, "moe_pad_expert_input_to_capacity", False)
        or options.transport not in SYNC_FREE_TRANSPORTS
        or "moe" not in graph_regions(getattr(config, key, None))
    ):
        yield
        return
    setattr(tc_module, name, _without_moe(real, name))
    try:
        yield
    finally:
        setattr(tc_module, name, real)
    _check_moe_region(config, real, key)


@contextlib.contextmanager
def _megatron_budget_hidden(config: Any) -> Iterator[None]:
    """megatron-core 0.19 refuses ``moe_expert_rank_capacity_factor`` unless the flex backend is ``hybridep`` or
    ``ncclep``; ``ep_plugin`` takes it as its row budget (``options.row_budget``), so Megatron's checks run without
    it and ``check_budget`` checks it afterwards."""
    factor = getattr(config, MEGATRON_BUDGET_KEY, None)
    if factor is None:
        yield
        return
    setattr(config, MEGATRON_BUDGET_KEY, None)
    try:
        yield
    finally:
        setattr(config, MEGATRON_BUDGET_KEY, factor)


def _without_moe(real: type, name: str) -> type:
    """A stand-in named ``name`` for the enum ``real`` whose ``moe`` is a fresh object."""

    class _Meta(type):
        def __getattr__(cls, attr: str) -> Any:
            return object() if attr == "moe" else getattr(real, attr)

        def __getitem__(cls, item: str) -> Any:
            return real[item]

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, real)

        def __iter__(cls) -> Iterator[Any]:
            return iter(real)

    return _Meta(name, (), {})


def _check_moe_region(config: Any, regions_enum: type, key: str) -> None:
    """Megatron's own checks of a ``moe`` region in a per-layer graph (``local``/``transformer_engine``) other
    than the drop-and-pad one, with its messages: ``TransformerConfig.__post_init__`` of megatron-core 0.16.1
    (``cuda_graph_scope``) and 0.19.2 (``cuda_graph_modules``, which adds the GTP and offloading rules)."""
    regions = getattr(config, key)
    impl = config.cuda_graph_impl
    if regions_enum.moe_router in regions:
        raise AssertionError(f"{key} must not contain both moe and moe_router.")
    if config.overlap_moe_expert_parallel_comm and (key == "cuda_graph_scope" or impl == "transformer_engine"):
        raise AssertionError("CUDA graph scope on moe and mlp is not supported with overlap_moe_expert_parallel_comm")
    if key == "cuda_graph_modules" and getattr(config, "fine_grained_activation_offloading", False):
        raise AssertionError("Token-drop MoE is temporarily not supported with activation offloading.")
    if config.recompute_granularity != "selective":
        return
    if "moe" in config.recompute_modules and config.hidden_dropout != 0.0:
        raise AssertionError("hidden dropout is not supported with graphed MLP/MoE recomputation.")
    if "moe" in config.recompute_modules and config.moe_input_jitter_eps is not None:
        raise AssertionError("moe_input_jitter_eps is not supported with graphed moe recomputation.")
    if (
        getattr(config, "gtp_weight_remat_size", 1) > 1
        and impl == "local"
        and (config.fp8 is not None or config.fp4 is not None)
        and config.moe_shared_expert_intermediate_size is not None
        and not config.moe_shared_expert_overlap
        and "shared_experts" in config.recompute_modules
    ):
        raise AssertionError(
            "GTP + local CUDA graphs that capture shared_experts (moe_router/moe scope) cannot recompute it under "
            "fp8/fp4; drop 'shared_experts' from --recompute-modules, or use --cuda-graph-impl full_iteration."
        )


def _check_flex_capture(config: Any, options: PluginOptions) -> bool:
    """Whether ``config``'s CUDA-graph region holds a ``flex`` dispatch that reads nothing on the host (then
    accepted, True), None held (False), or else a ValueError naming the key that makes it capturable. Capturable:
    the shims' device-sized forms on a transport that reads nothing (``SYNC_FREE_TRANSPORTS``), called by Megatron
    in a way that reads nothing either: ``hybridep`` with a static row budget (drop-and-pad, or 0.19's
    ``moe_expert_rank_capacity_factor``) and without ``moe_hybridep_pad_uneven_dispatch_inputs`` (its manager
    reads the group's token count); ``ncclep`` with ``moe_ncclep_static_shape`` (else its manager reads the row
    count). ``deepep`` returns its counts on the host; ``deepepv2``'s shim reads nothing with ``do_cpu_sync=False``,
    but Megatron's ``_DeepepV2Manager`` neither passes that nor permutes without reading the count (the ``deepep``
    manager's ``tokens_per_expert.sum().item()``), so it is refused whatever the shim does."""
    what = captured_dispatch(config)
    if what is None:
        return False
    backend = getattr(config, "moe_flex_dispatcher_backend", "deepep")
    if backend not in SERVED_FLEX_BACKENDS:
        return False  # _check_flex names the backend
    fix = None
    if backend == "hybridep":
        budget_keys = ("moe_pad_expert_input_to_capacity", MEGATRON_BUDGET_KEY)
        if not any(getattr(config, key, None) not in (None, False) for key in budget_keys):
            given = [key for key in budget_keys if hasattr(config, key)]
            fix = f"set {' or '.join(given)} (a static row budget, num_permuted_tokens)"
        elif getattr(config, "moe_hybridep_pad_uneven_dispatch_inputs", False):
            fix = "unset moe_hybridep_pad_uneven_dispatch_inputs (its manager reads the group's token count)"
    elif backend == "ncclep":
        if not getattr(config, "moe_ncclep_static_shape", False):
            fix = "set moe_ncclep_static_shape: true (else its manager reads the received row count)"
    else:
        # deepepv2 too: its manager permutes with the host's tokens_per_expert.sum().item(), whatever the shim returns
        fix = (
            "use moe_flex_dispatcher_backend: hybridep or ncclep with a static budget, or moe_token_dispatcher_type: "
            "ep_plugin with ep_plugin.transport: nvlink"
        )
    if fix is None and options.transport not in SYNC_FREE_TRANSPORTS:
        fix = "set ep_plugin.transport: nvlink, which reads nothing on the host"
    if fix is not None:
        raise ValueError(
            f"{what} captures the MoE token dispatch, which moe_flex_dispatcher_backend {backend!r} runs with one "
            f"host read of its counts here (not capturable); {fix}, or capture attn, moe_router or moe_preprocess only"
        )
    return True


def _check_batch_invariant(config: Any) -> None:
    """``batch_invariant_mode`` with ``ep_plugin``: a token's output must not depend on the other tokens of its
    batch. The plugin's dispatch copies rows and its combine sums each token's rows in one fixed order (its top-k
    order on each rank, then its destination ranks in an order of its own top-k row), whatever the batch holds, so
    it is accepted (Megatron-LM main's check, which wants ``alltoall``, sees ``ep_plugin`` validated as
    ``alltoall``). Token dropping decides by the whole batch which tokens lose experts: refused, as main refuses
    padding for ``alltoall``."""
    if not getattr(config, "batch_invariant_mode", False):
        return
    for key in ("moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"):
        if getattr(config, key, None) not in (None, False):
            raise ValueError(
                f"{key}: batch_invariant_mode with moe_token_dispatcher_type: ep_plugin serves dropless "
                f"routing only (which tokens a capacity drops depends on the whole batch); unset {key}"
            )


def _free_input_module() -> Any:
    """The Megatron module that defines the overlap schedule's ``should_free_input``."""
    for name in _FREE_INPUT_MODULES:
        module = importlib.import_module(name) if importlib.util.find_spec(name) else None
        if module is not None and hasattr(module, "should_free_input"):
            return module
    raise RuntimeError(
        f"megatron-core {getattr(megatron.core, '__version__', '?')}: should_free_input is in none "
        f"of {', '.join(_FREE_INPUT_MODULES)}; this layout is not supported"
    )


def _wrap_should_free_input(original: Any) -> Any:
    """Under the overlap schedule a node may free its input after forward, which is safe where the tensor was a
    copy nobody saved for backward (``alltoall`` permutes the tokens before its dispatch and sorts the received
    rows by expert after it). The plugin's ``dispatch_preprocess`` only reshapes the layernorm output (which the
    router saved) and its ``dispatch_postprocess`` hands the received rows to the experts unchanged (which save
    them): for ``ep_plugin`` the ``moe_dispatch`` and ``mlp`` inputs are kept, as Megatron keeps ``hybridep``'s.
    Keeping them costs no memory, both tensors being saved for backward anyway. The ``moe_combine`` input may go:
    the plugin's combine saves none of it."""

    @functools.wraps(original)
    def should_free_input(name: str, is_moe: bool, config: Any, *args: Any) -> bool:
        if getattr(config, "moe_token_dispatcher_type", None) == PLUGIN_DISPATCHER_TYPE and name in (
            "moe_dispatch",
            "mlp",
        ):
            return False
        return original(name, is_moe, config, *args)

    return should_free_input


def _check_flex(config: Any) -> None:
    """A ``flex`` config asks for a backend this library serves, with plugin options it can honour (FP8 dispatch
    needs BF16 tokens and the hidden size a multiple of 128): else a ValueError naming the key, at config time."""
    backend = getattr(config, "moe_flex_dispatcher_backend", "deepep")
    if backend not in SERVED_FLEX_BACKENDS:
        raise ValueError(
            f"moe_flex_dispatcher_backend: {backend!r} is not served by moe_ep_plugin on megatron-core "
            f"{getattr(megatron.core, '__version__', '?')} (served: {', '.join(SERVED_FLEX_BACKENDS)})"
        )
    expert_tp = getattr(config, "expert_tensor_parallel_size", None) or 1
    if backend == "hybridep" and getattr(config, "moe_pad_expert_input_to_capacity", False) and expert_tp > 1:
        # Megatron's _HybridEPManager sizes the capacity from its TP x E experts while the router pads every expert
        # to the capacity of E: the row budget it passes is smaller than the rows sent, which would be dropped.
        raise ValueError(
            f"moe_pad_expert_input_to_capacity with moe_flex_dispatcher_backend: 'hybridep' needs "
            f"expert_tensor_parallel_size 1, got {expert_tp} (Megatron's hybridep capacity counts TP "
            f"x experts); use moe_token_dispatcher_type: ep_plugin or alltoall"
        )
    options = get_plugin_options(config, _default_options)
    check_fp16(config, options)  # fp16 tokens travel as they are on every transport, but not through FP8 dispatch
    check_budget(config, options)
    hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
    if options.fp8_dispatch and hidden % 128:
        raise ValueError(
            f"ep_plugin.fp8_dispatch: FP8 dispatch on the flex + {backend} path needs the dispatched "
            f"hidden size to be a multiple of 128, got {hidden}"
        )


def is_installed() -> bool:
    return getattr(moe_layer.MoELayer.__init__, "_moe_ep_plugin", False)


def install(options: PluginOptions | None = None) -> None:
    """Register ``ep_plugin`` and serve ``flex`` + ``deepep`` with this library. ``options`` are the defaults
    for configs that carry none (and the options of the DeepEP shim). Calling it again only updates them."""
    global _default_options
    if options is not None and not isinstance(options, PluginOptions):
        raise TypeError(f"options: expected PluginOptions or None, got {type(options).__name__}")
    _check_version()
    _default_options = options if options is not None else PluginOptions()
    deepep_shim.configure(_default_options)
    if is_installed():
        return
    _patch(moe_layer.MoELayer, "__init__", _wrap_moe_layer_init(moe_layer.MoELayer.__init__))
    free_input = _free_input_module()
    _patch(free_input, "should_free_input", _wrap_should_free_input(free_input.should_free_input))
    config_cls = tc_module.TransformerConfig
    _patch(config_cls, "__post_init__", _wrap_post_init(config_cls.__post_init__))
    for module in (token_dispatcher, fused_a2a):
        for shim, names in _SHIMS:
            for name in names:
                if hasattr(module, name):  # token_dispatcher does not import nccl_ep_finalize
                    _patch(module, name, getattr(shim, name))


def uninstall() -> None:
    """Restore everything :func:`install` replaced; a no-op when not installed."""
    global _default_options
    for (owner, name), value in reversed(list(_originals.items())):
        setattr(owner, name, value)
    _originals.clear()
    _default_options = PluginOptions()
    deepep_shim.configure(_default_options)
    ncclep_shim.nccl_ep_finalize()
    deepepv2_shim.reset_elastic_buffer()
