"""The DeepSpeed layer's grouped experts (``expert_compute``): which expert modules run as one grouped FFN, and the
grouped path equals DeepSpeed's per-expert loop in outputs and every gradient (CPU, fp32: only the summation
order of the bias terms differs), also for experts without rows."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

from test_deepspeed_moe import assert_close, assert_same, ds_finish, ds_init, run_step  # noqa: E402

from moe_ep_plugin import launch  # noqa: E402
from moe_ep_plugin.deepspeed.ffn import ffn_structure  # noqa: E402


class FFN(nn.Module):
    """``fc2(act(fc1(x)))``; ``act`` is called as written in :meth:`forward` (subclasses vary it)."""

    def __init__(self, hidden: int = 16, ffn: int = 24, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class TanhGelu(FFN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TwoActivations(FFN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.leaky_relu(self.fc1(x), 0.2).relu())


class Residual(FFN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) + x


class Gated(FFN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(F.silu(h) * h)


class Branchy(FFN):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x))) if x.sum() > 0 else x


class MyLinear(nn.Linear):
    pass


def _hooked() -> nn.Module:
    expert = FFN()
    expert.fc1.register_forward_hook(lambda module, args, out: out * 2)
    return expert


@pytest.mark.parametrize(
    "make, grouped",
    [
        (FFN, True),
        (TanhGelu, True),
        (lambda: FFN(bias=False), True),
        (lambda: nn.Sequential(nn.Linear(16, 24), nn.SiLU(), nn.Linear(24, 16)), True),
        (TwoActivations, False),
        (Residual, False),
        (Gated, False),
        (Branchy, False),
        (_hooked, False),
        (lambda: nn.Sequential(nn.Linear(16, 24), nn.Dropout(0.1), nn.Linear(24, 16)), False),
        (lambda: nn.Sequential(nn.Linear(16, 24), nn.PReLU(), nn.Linear(24, 16)), False),  # has a parameter
        (lambda: nn.Sequential(MyLinear(16, 24), nn.GELU(), nn.Linear(24, 16)), False),
        (lambda: nn.Linear(16, 16), False),
    ],
)
def test_which_experts_run_grouped(make, grouped):
    expert = make()
    structure = ffn_structure(expert)
    assert (structure is not None) == grouped
    if structure is not None:  # the activation found is the one the module applies
        first, activation, second = structure
        x = torch.randn(5, 16)
        ref = expert.get_submodule(second)(activation(expert.get_submodule(first)(x)))
        assert torch.equal(ref, expert(x))
        assert torch.equal(pickle.loads(pickle.dumps(activation))(x), activation(x))  # the layer pickles


def _random_counts(num_experts: int, rows: int, gen: torch.Generator) -> list[int]:
    """``rows`` over ``num_experts`` with about half the experts given none (at least one always)."""
    owners = torch.randperm(num_experts, generator=gen)[: max(num_experts // 2, 1)]
    picks = owners[torch.randint(len(owners), (rows,), generator=gen)]
    return torch.bincount(picks, minlength=num_experts).tolist()


def _experts_step(layer, rows: torch.Tensor, counts: list[int], grad_out: torch.Tensor):
    """``layer.run_experts`` forward + backward → (output, rows' gradient, {expert parameter name: gradient})."""
    layer.zero_grad(set_to_none=True)
    rows = rows.clone().requires_grad_(True)
    out = layer.run_experts(rows, counts)
    (out * grad_out).sum().backward()
    return out.detach(), rows.grad, {n: p.grad for n, p in layer.experts.named_parameters()}


def _randomize_experts(moe: nn.Module, seed: int) -> None:
    """Different weights for every expert (DeepSpeed deep-copies one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _pair(make_expert, *args, **kwargs) -> dict[str, nn.Module]:
    """The plugin MoE with ``expert_compute`` grouped and loop, identical weights."""
    from moe_ep_plugin.deepspeed import MoE

    moes = {impl: MoE(16, make_expert(), *args, **kwargs, expert_compute=impl) for impl in ("grouped", "loop")}
    _randomize_experts(moes["loop"], 5)
    moes["grouped"].load_state_dict(moes["loop"].state_dict())
    return moes


@pytest.mark.parametrize("rows", [40, 0])
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_experts_equal_the_loop_also_without_rows(rows, bias):
    gen = torch.Generator().manual_seed(rows + bias)
    layers = {impl: moe.deepspeed_moe for impl, moe in _pair(lambda: FFN(bias=bias), num_experts=6).items()}
    assert layers["grouped"]._grouped is not None
    counts = _random_counts(6, rows, gen)
    assert sum(counts) == rows and 0 in counts
    x, grad_out = torch.randn(rows, 16, generator=gen), torch.randn(rows, 16, generator=gen)
    (out_g, dx_g, grads_g), (out_l, dx_l, grads_l) = (
        _experts_step(layers[i], x, counts, grad_out) for i in ("grouped", "loop")
    )
    assert_close(out_g, out_l, "output")
    assert_close(dx_g, dx_l, "rows' gradient")
    assert grads_g.keys() == grads_l.keys()
    for name, grad in grads_l.items():
        assert_close(grads_g[name], grad, name)
        if counts[int(name.split(".")[1])] == 0:  # deepspeed_experts.<l>.fc1.weight: an expert without rows
            assert not grads_g[name].any() and not grad.any(), name


def _worker_layer_grouped_equals_loop() -> None:
    ds_init()
    gen = torch.Generator().manual_seed(11)
    for k, num_experts in ((1, 8), (2, 8), (8, 16)):
        moes = _pair(FFN, num_experts, 1, k)
        dead = torch.arange(0, num_experts, 4)  # never chosen: a large negative logit on feature 0
        with torch.no_grad():
            moes["loop"].deepspeed_moe.gate.wg.weight[dead, 0] = -50.0
            moes["grouped"].deepspeed_moe.gate.wg.weight.copy_(moes["loop"].deepspeed_moe.gate.wg.weight)
        x = torch.randn(2, 12, 16, generator=gen)
        x[..., 0] = 3.0
        grad_out = torch.randn(x.shape, generator=gen)
        for moe in moes.values():
            moe.set_deepspeed_parallelism()
        results = {impl: run_step(moe, x, grad_out, seed=k) for impl, moe in moes.items()}
        assert not results["loop"][2][dead].any(), f"k={k}: {results['loop'][2]}"
        assert_same(results["loop"], results["grouped"], f"k={k}")
    ds_finish()


def test_layer_grouped_equals_loop_k1_k2_k8():
    launch.spawn(_worker_layer_grouped_equals_loop, 1)


def test_expert_compute_is_checked():
    from moe_ep_plugin.deepspeed import MoE

    with pytest.raises(ValueError, match="^expert_compute: expected one of"):
        MoE(16, FFN(), num_experts=2, expert_compute="fast")
    with pytest.raises(ValueError, match="^expert_compute: 'grouped' needs experts whose forward is Linear"):
        MoE(16, Gated(), num_experts=2, expert_compute="grouped")
    assert MoE(16, Gated(), num_experts=2).deepspeed_moe._grouped is None  # auto: the loop
    # widths torch's grouped matmul refuses (6 and 5 floats are not multiples of 16 bytes): 'grouped' says so,
    # 'auto' runs DeepSpeed's loop
    rows = torch.randn(4, 6)
    with pytest.raises(ValueError, match="^expert_compute: 'grouped' cannot run"):
        MoE(6, FFN(6, 5), num_experts=2, expert_compute="grouped").deepspeed_moe.run_experts(rows, [1, 3])
    layer = MoE(6, FFN(6, 5), num_experts=2).deepspeed_moe
    assert layer._grouped.resolve("auto", rows) == "loop"
    assert layer.run_experts(rows, [1, 3]).shape == (4, 6)
