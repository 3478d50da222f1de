"""The trainer's routed experts: grouped and loop GEMMs give the same training step; the MFU FLOP count.

On CPU torch's grouped matmul is the same per-expert matmul, so with the same weights and data one EP=2 step
with ``moe.expert_compute: grouped`` equals the step with ``loop`` bit for bit (loss, counts, every gradient,
the clipped norm). The FLOPs per token are checked against a count made from the built model's parameters.
"""

import torch
import torch.distributed as dist

from moe_ep_plugin import launch
from moe_ep_plugin.recipes.train import config, metrics
from moe_ep_plugin.recipes.train.model import MoETransformer
from moe_ep_plugin.recipes.train.trainer import Trainer


def _config(impl: str, ep: int = 2) -> config.TrainerConfig:
    return config.from_dict(
        {
            "model": {
                "hidden_size": 32,
                "num_layers": 3,
                "num_dense_layers": 1,
                "num_heads": 4,
                "ffn_hidden_size": 48,
                "seq_len": 16,
                "dtype": "float32",
            },
            "moe": {
                "num_experts": 8,
                "expert_ffn_hidden_size": 16,
                "topk": 3,
                "num_groups": 4,
                "group_topk": 2,
                "expert_compute": impl,
            },
            "parallel": {"nprocs": ep, "device": "cpu", "transport": "torch"},
            "train": {"micro_batch_size": 3, "grad_clip": 0.5},
        }
    )


def _step(impl: str):
    trainer = Trainer(_config(impl))
    # a skewed bias so some local expert receives no rows on some rank
    for layer in trainer.model.moe_layers():
        layer.expert_bias.copy_(torch.tensor([3.0, 3.0, 3.0, -9.0, 0.0, 0.0, -9.0, -9.0]))
    result = trainer.forward_backward(*trainer.batch(0))
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    norm = trainer.clip_gradients()
    trainer.buffer.destroy()
    return result, grads, norm


def _compare() -> None:
    (r_loop, g_loop, n_loop), (r_grp, g_grp, n_grp) = _step("loop"), _step("grouped")
    assert torch.equal(r_loop.counts, r_grp.counts)
    assert (r_loop.counts == 0).any(), "the bias should leave some expert without tokens"
    assert r_loop.lm_loss == r_grp.lm_loss and r_loop.aux_loss == r_grp.aux_loss and n_loop == n_grp
    assert g_loop.keys() == g_grp.keys()
    for name, grad in g_loop.items():
        assert torch.equal(grad, g_grp[name]), (dist.get_rank(), name)


def test_grouped_and_loop_experts_give_the_same_step_ep2():
    launch.spawn(_compare, 2)


def test_train_flops_per_token_counts_the_model_matmuls():
    cfg = _config("auto", ep=1)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    m, e = cfg.model, cfg.moe
    per_token = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.startswith("embed."):
            continue  # norms; the embedding is a lookup
        share = e.topk / e.num_experts if ".experts." in name else 1.0  # a token uses topk of the E experts
        per_token += p.numel() * share
    attention = m.num_layers * 2 * m.seq_len * m.hidden_size  # causal QK^T and AV over S/2 keys
    assert metrics.train_flops_per_token(cfg) == 3 * (2 * per_token + attention)


def test_mfu_needs_a_peak_and_divides_by_devices():
    cfg = _config("auto")
    peak, source = metrics.peak_flops(cfg, torch.device("cpu"), torch.float32)
    assert peak is None and "n/a" in source
    assert metrics.mfu(1000.0, 2, 6e9, None) is None
    given = config.from_dict({**cfg.to_dict(), "output": {**cfg.to_dict()["output"], "peak_tflops": 2.0}})
    peak, source = metrics.peak_flops(given, torch.device("cpu"), torch.float32)
    assert peak == 2e12 and "output.peak_tflops" in source
    assert metrics.mfu(1000.0, 2, 6e9, peak) == 1000.0 * 6e9 / (2 * 2e12)
