"""DeepSpeed's local experts as one grouped FFN, when every expert is Linear → elementwise activation → Linear.

DeepSpeed's ``Experts`` holds ``L`` deep copies of the user's expert module and runs them one after another.
When the copies are two-layer FFNs, :class:`GroupedFFN` stacks their weights on every forward (``torch.stack`` is
differentiable, so each expert's own parameters still receive their gradients, and DeepSpeed's parameter names,
``is_moe_param`` tags, expert-parallel gradient groups, ZeRO partitions and checkpoint files stay as they are) and
runs :func:`moe_ep_plugin.experts.ffn_experts`: one grouped matmul per projection instead of ``2 L`` matmuls over
chunks cut with host counts. The structure comes from a ``torch.fx`` trace of the expert's forward, so
``nn.Sequential(Linear, GELU(), Linear)`` and a module whose forward is ``fc2(gelu(fc1(x)))`` both qualify;
anything else (more layers, gated units, dropout, norms, a ``Linear`` subclass, module hooks, a tuple output)
keeps DeepSpeed's per-expert loop.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import experts

# elementwise and stateless: one callable serves every expert
_ACTIVATION_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.LeakyReLU,
    nn.Softplus,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Identity,
)
_ACTIVATION_FUNCTIONS = (
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.mish,
    F.elu,
    F.celu,
    F.selu,
    F.leaky_relu,
    F.softplus,
    F.sigmoid,
    F.tanh,
    F.hardswish,
    F.hardsigmoid,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
)
_ACTIVATION_METHODS = ("relu", "sigmoid", "tanh")

Structure = tuple[str, Callable[[torch.Tensor], torch.Tensor], str]


def _hooked(module: nn.Module) -> bool:
    """Forward hooks would be skipped when the stacked weights run instead of the module."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


class _Call:
    """``fn(t, *args, **kwargs)`` as a callable of ``t`` that pickles with the layer (a lambda would not)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.fn(t, *self.args, **self.kwargs)


def _activation(expert: nn.Module, node: fx.Node, source: fx.Node) -> Callable | None:
    """``node`` as a callable of one tensor, if it is an allowed elementwise activation applied to ``source``
    with constant extra arguments (``approximate="tanh"``, ``negative_slope``, ``inplace``)."""
    if not node.args or node.args[0] is not source:
        return None
    inputs: list[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), inputs.append)
    if inputs:
        return None
    extra, kwargs = node.args[1:], dict(node.kwargs)
    if node.op == "call_module":
        module = expert.get_submodule(node.target)
        if type(module) in _ACTIVATION_MODULES and not extra and not kwargs and not _hooked(module):
            return module
    elif node.op == "call_function" and any(node.target is fn for fn in _ACTIVATION_FUNCTIONS):
        return _Call(node.target, extra, kwargs)
    elif node.op == "call_method" and node.target in _ACTIVATION_METHODS:
        return operator.methodcaller(node.target, *extra, **kwargs)
    return None


def ffn_structure(expert: nn.Module) -> Structure | None:
    """``(first Linear's module path, activation, second Linear's module path)`` when ``expert``'s forward is
    exactly ``Linear → elementwise activation → Linear`` of its one input; None for anything else."""
    try:
        nodes = list(fx.symbolic_trace(expert).graph.nodes)
    except Exception:  # noqa: BLE001 -- control flow on values, untraceable code: not a plain FFN, keep the loop
        return None
    if len(nodes) != 5 or _hooked(expert):
        return None
    x, first, act, second, out = nodes
    if (x.op, first.op, second.op, out.op) != ("placeholder", "call_module", "call_module", "output"):
        return None
    if first.args != (x,) or second.args != (act,) or out.args != (second,) or first.kwargs or second.kwargs:
        return None
    linears = [expert.get_submodule(node.target) for node in (first, second)]
    if any(type(m) is not nn.Linear or _hooked(m) for m in linears):
        return None
    activation = _activation(expert, act, first)
    return None if activation is None else (first.target, activation, second.target)


class GroupedFFN:
    """The local experts of one DeepSpeed ``Experts`` module run as one grouped two-layer FFN."""

    def __init__(self, local_experts: Sequence[nn.Module], structure: Structure) -> None:
        first, self.activation, second = structure
        self.first = [expert.get_submodule(first) for expert in local_experts]
        self.second = [expert.get_submodule(second) for expert in local_experts]

    @classmethod
    def of(cls, local_experts: Sequence[nn.Module]) -> GroupedFFN | None:
        """The grouped form of ``local_experts`` (DeepSpeed's ``deepspeed_experts``), or None when they are not
        two-layer FFNs of one shape (DeepSpeed deep-copies one expert, so they agree unless changed since)."""
        structure = ffn_structure(local_experts[0]) if len(local_experts) else None
        if structure is None or any(type(e) is not type(local_experts[0]) or _hooked(e) for e in local_experts):
            return None
        grouped = cls(local_experts, structure)
        for linears in (grouped.first, grouped.second):
            if (
                any(type(m) is not nn.Linear or _hooked(m) for m in linears)
                or len({(m.weight.shape, m.bias is None) for m in linears}) != 1
            ):
                return None
        return grouped

    def resolve(self, expert_compute: str, rows: torch.Tensor) -> str:
        """``expert_compute`` (``auto``/``grouped``/``loop``) → ``"grouped"`` or ``"loop"`` for ``rows``, decided
        before anything is stacked: on stand-ins of the stacked weights' dtype, device and ``[L, K, N]`` shape (a
        fresh stack is aligned whenever its widths are, which the check covers)."""
        stand_ins = [
            m[0].weight.new_empty(()).expand(len(m), m[0].in_features, m[0].out_features)
            for m in (self.first, self.second)
        ]
        return experts.resolve_impl(expert_compute, rows, *stand_ins, name="expert_compute")

    def __call__(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """``rows [M, H]`` expert-major (``counts[l]`` rows of local expert ``l``) → ``[M, H]`` in ``rows.dtype``."""
        w1, b1 = _stacked(self.first)
        w2, b2 = _stacked(self.second)
        return experts.ffn_experts(rows, w1, b1, self.activation, w2, b2, counts, "grouped")


def _stacked(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``L`` Linears ``[N, K]`` → the weights as ``[L, K, N]`` (a transposed view of their stack) and the
    biases ``[L, N]`` (None without biases)."""
    weight = torch.stack([m.weight for m in linears]).transpose(1, 2)
    bias = None if linears[0].bias is None else torch.stack([m.bias for m in linears])
    return weight, bias
