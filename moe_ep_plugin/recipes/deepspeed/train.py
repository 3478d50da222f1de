"""Train a small MoE language model with ``deepspeed.initialize``, the dispatcher chosen by the config.

Runs on every rank of an initialised process group (gloo on CPU, NCCL on GPUs). The model is an embedding,
``num_layers`` pre-norm residual blocks whose MLP is a DeepSpeed MoE layer (stock ``deepspeed.moe.layer.MoE`` or
``moe_ep_plugin.deepspeed.MoE``), a final norm and an LM head; with ``dispatcher: autoep`` it is a tiny Mixtral whose
MoE blocks DeepSpeed AutoEP replaces (:mod:`.autoep`). The data is a synthetic next-token task a
token-wise model can learn (each token is followed by a fixed successor 90% of the time), so the loss falls
from ln(vocab) within a few dozen steps. The optimizer is a plain ``torch.optim.AdamW`` over DeepSpeed's MoE
parameter groups, and on CPU DeepSpeed's shared-memory allreduce op is switched off (:func:`init_deepspeed_comm`):
no DeepSpeed op is compiled, on CPU or GPU.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from ...buffer_cache import cached_transports, destroy_buffers
from ...deepspeed.layer import MoE, update_expert_biases
from ..common import checkpoint, progress, schedule
from . import autoep
from .config import RunConfig, compare_configs, validate

SUCCESSOR_PROB = 0.9


class ExpertMLP(torch.nn.Module):
    """``[T, H]`` → ``[T, H]``: Linear, GELU, Linear."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(torch.nn.Module):
    def __init__(self, moe: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.moe = moe

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, l_aux, _ = self.moe(self.norm(h))
        return h + out, l_aux


class TinyMoELM(torch.nn.Module):
    """``tokens [B, S]`` int64 → ``(logits [B, S, V], sum of the layers' l_aux)``."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        h = cfg.model.hidden_size
        self.embed = torch.nn.Embedding(cfg.model.vocab_size, h)
        self.blocks = torch.nn.ModuleList(MoEBlock(build_moe(cfg), h) for _ in range(cfg.model.num_layers))
        self.norm = torch.nn.LayerNorm(h)
        self.head = torch.nn.Linear(h, cfg.model.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(tokens)
        l_aux = h.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            h, aux = block(h)
            l_aux = l_aux + aux
        return self.head(self.norm(h)), l_aux


def build_moe(cfg: RunConfig) -> torch.nn.Module:
    """One MoE layer of the configured dispatcher, constructed with DeepSpeed's argument names."""
    m = cfg.moe
    expert = ExpertMLP(cfg.model.hidden_size, cfg.model.ffn_hidden_size)
    args = dict(
        hidden_size=cfg.model.hidden_size,
        expert=expert,
        num_experts=m.num_experts,
        ep_size=m.ep_size,
        k=m.k,
        capacity_factor=m.capacity_factor,
        eval_capacity_factor=m.eval_capacity_factor,
        min_capacity=m.min_capacity,
        use_residual=m.use_residual,
        noisy_gate_policy=m.noisy_gate_policy,
        drop_tokens=m.drop_tokens,
        use_rts=m.use_rts,
        top2_2nd_expert_sampling=m.top2_2nd_expert_sampling,
    )
    if cfg.dispatcher == "deepspeed":
        return deepspeed.moe.layer.MoE(**args)
    return MoE(**args, **dataclasses.asdict(m.plugin_options()))


def _init_experts(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Give every global expert its own initial weights (DeepSpeed deep-copies one expert into all of them).

    The EP rank is ``rank % ep_size``: DeepSpeed's default layout puts consecutive ranks in one EP group.
    """
    ep_rank = dist.get_rank() % cfg.moe.ep_size
    local = cfg.moe.num_experts // cfg.moe.ep_size
    for layer_idx, block in enumerate(model.blocks):
        for i, expert in enumerate(block.moe.deepspeed_moe.experts.deepspeed_experts):
            global_id = layer_idx * cfg.moe.num_experts + ep_rank * local + i
            gen = torch.Generator().manual_seed(cfg.train.seed + 1 + global_id)
            with torch.no_grad():
                for p in expert.parameters():
                    bound = 1.0 / p.shape[-1] ** 0.5
                    p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)


def deepspeed_config(cfg: RunConfig) -> dict:
    """The user's ``deepspeed`` section plus what the ``train`` section decides."""
    ds = dict(cfg.deepspeed)
    ds["train_micro_batch_size_per_gpu"] = cfg.train.micro_batch_size
    ds["gradient_accumulation_steps"] = 1
    ds["bf16"] = {"enabled": cfg.train.torch_dtype() == torch.bfloat16}
    ds.setdefault("zero_allow_untested_optimizer", True)  # ZeRO wrapping torch's AdamW
    if cfg.dispatcher == "autoep":
        ds.update(autoep.deepspeed_section(cfg))
    return ds


def build_model(cfg: RunConfig) -> torch.nn.Module:
    """The model of ``cfg``, seeded by ``train.seed`` (the same weights for either dispatcher)."""
    if cfg.dispatcher == "autoep":
        return autoep.build_model(cfg)
    torch.manual_seed(cfg.train.seed)
    model = TinyMoELM(cfg)
    _init_experts(model, cfg)
    return model


def initialize(model: torch.nn.Module, cfg: RunConfig) -> deepspeed.DeepSpeedEngine:
    """``deepspeed.initialize`` with AdamW over DeepSpeed's MoE parameter groups (AutoEP: DeepSpeed's AdamW, built
    after AutoEP has sharded the experts)."""
    if cfg.dispatcher == "autoep":
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=deepspeed_config(cfg)
        )
        return engine
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg))
    return engine


def build_engine(cfg: RunConfig) -> deepspeed.DeepSpeedEngine:
    """:func:`build_model` + :func:`initialize`."""
    return initialize(build_model(cfg), cfg)


def batch(cfg: RunConfig, step: int, device: torch.device) -> torch.Tensor:
    """``[B, S + 1]`` tokens for this rank and step: a fixed successor map followed with probability 0.9."""
    v, s = cfg.model.vocab_size, cfg.model.seq_len
    successor = torch.randperm(v, generator=torch.Generator().manual_seed(cfg.train.seed))
    gen = torch.Generator().manual_seed(cfg.train.seed + 7919 * (step + 1) + dist.get_rank())
    tokens = torch.empty(cfg.train.micro_batch_size, s + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(v, (cfg.train.micro_batch_size,), generator=gen)
    noise = torch.randint(v, tokens.shape, generator=gen)
    follow = torch.rand(tokens.shape, generator=gen) < SUCCESSOR_PROB
    for i in range(s):
        tokens[:, i + 1] = torch.where(follow[:, i + 1], successor[tokens[:, i]], noise[:, i + 1])
    return tokens.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TrainResult:
    """What one training run measured."""

    losses: list[float]  # per step, averaged over all ranks
    step_times_s: list[float]  # per step, slowest rank
    tokens_per_step: int  # over all ranks
    transport: str = ""  # what moved the tokens

    def median_step_s(self, warmup: int) -> float:
        times = self.step_times_s[warmup:] or self.step_times_s
        return statistics.median(times)


def train_steps(
    engine: deepspeed.DeepSpeedEngine, cfg: RunConfig, first_step: int, num_steps: int, log: bool = False
) -> TrainResult:
    """Run steps ``first_step ..`` of the synthetic task; losses are all-rank means, times the slowest rank's."""
    device = engine.device
    losses, times = [], []
    for step in range(first_step, first_step + num_steps):
        tokens = batch(cfg, step, device)
        schedule.set_lr(engine.optimizer, cfg.train.lr_at(step))
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        logits, l_aux = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        total = loss + cfg.moe.aux_loss_coeff * l_aux
        engine.backward(total)
        engine.step()
        if cfg.moe.expert_bias_rate > 0:
            update_expert_biases(engine.module)
        _sync(device)
        stats = torch.tensor([loss.item(), time.perf_counter() - start], dtype=torch.float64, device=device)
        elapsed = stats[1:].clone()
        dist.all_reduce(stats[:1])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        losses.append(float(stats[0]) / dist.get_world_size())
        times.append(float(elapsed[0]))
        if (
            log
            and dist.get_rank() == 0
            and progress.due(step + 1, first_step + num_steps, cfg.train.log_interval, first_step)
        ):
            print(
                progress.line(
                    step + 1,
                    first_step + num_steps,
                    [
                        f"loss {losses[-1]:.4f}",
                        f"lr {cfg.train.lr_at(step):.2e}",
                        f"{1e3 * times[-1]:.2f} ms/step",
                        f"dispatcher {cfg.dispatcher}",
                    ],
                ),
                flush=True,
            )
    tokens = cfg.train.micro_batch_size * cfg.model.seq_len * dist.get_world_size()
    return TrainResult(losses, times, tokens)


def train(cfg: RunConfig) -> TrainResult:
    """Build, train ``train.steps`` steps (rank 0 logs), save a checkpoint if ``train.checkpoint_dir`` is set."""
    if cfg.dispatcher == "autoep":
        autoep.prepare(cfg)
    engine = build_engine(cfg)
    result = train_steps(engine, cfg, 0, cfg.train.steps, log=True)
    result.transport = _transport(cfg)
    if cfg.train.checkpoint_dir:
        checkpoint.save(
            cfg.train.checkpoint_dir,
            cfg.train.steps,
            dataclasses.asdict(cfg),
            write=lambda directory: engine.save_checkpoint(os.path.dirname(directory), tag=os.path.basename(directory)),
        )
    engine.destroy()  # release the optimizer's state before the next engine or the end of the process group
    return result


def _transport(cfg: RunConfig) -> str:
    """What moved the tokens of a run of ``cfg``."""
    if cfg.dispatcher == "deepspeed":
        return "padded all_to_all"
    if cfg.dispatcher == "autoep":
        # the package DeepSpeed's ``import deep_ep`` found (the table says whether this library served it)
        return (
            "all_to_all"
            if cfg.autoep.comm_backend == "comm"
            else f"deep_ep={sys.modules['deep_ep'].__name__.split('.')[0]}"
        )
    return "+".join(cached_transports()) + (" fp8" if cfg.moe.fp8_dispatch else "")


def compare(cfg: RunConfig) -> dict[str, TrainResult]:
    """Train with the baseline, then with this library (same weights and data) in this process group: stock
    DeepSpeed MoE vs the plugin's layer, or (``dispatcher: autoep``) AutoEP's ``comm`` backend vs its ``deepep``
    backend on this library; rank 0 prints a table of step times and losses."""
    runs = compare_configs(cfg, dist.get_world_size())
    results = {name: train(run_cfg) for name, run_cfg in runs.items()}
    if dist.get_rank() == 0:
        print(format_table(cfg, results), flush=True)
    if cfg.dispatcher == "autoep":  # the losses are all-rank means: every rank reaches the same verdict
        ok, line = autoep.verdict(results["autoep comm"].losses, results["autoep deepep"].losses)
        if dist.get_rank() == 0:
            print(line, flush=True)
        if not ok:
            raise RuntimeError(line)
    return results


def format_table(cfg: RunConfig, results: dict[str, TrainResult]) -> str:
    """Step time (median after ``train.warmup_steps``), throughput, speed-up over the first row, losses."""
    w = cfg.train.warmup_steps
    base = next(iter(results.values())).median_step_s(w)
    lines = [
        f"world {dist.get_world_size()}, EP {cfg.moe.ep_size}, E {cfg.moe.num_experts}, k {cfg.moe.k}, "
        f"H {cfg.model.hidden_size}, tokens/rank/step {cfg.train.micro_batch_size * cfg.model.seq_len}, "
        f"{cfg.train.torch_dtype()}, median over steps {w}..{cfg.train.steps - 1}",
        f"{'dispatcher':<14}{'transport':<23}{'step ms':>10}{'tokens/s':>12}{'speedup':>9}{'first loss':>12}"
        f"{'last loss':>11}",
    ]
    for name, r in results.items():
        t = r.median_step_s(w)
        lines.append(
            f"{name:<14}{r.transport:<23}{1e3 * t:>10.2f}{r.tokens_per_step / t:>12.0f}{base / t:>8.2f}x"
            f"{r.losses[0]:>12.4f}{r.losses[-1]:>11.4f}"
        )
    return "\n".join(lines)


def init_deepspeed_comm() -> None:
    """Join DeepSpeed's comm to the process group already initialised.

    On gloo (CPU ranks) DeepSpeed's CPU accelerator would JIT-compile its shared-memory allreduce op
    (``deepspeed_shm_comm``: a C++ compiler and about 60 s) on first use; gloo serves these runs, so the op is
    marked unavailable in DeepSpeed's own table of compatible ops and nothing is compiled.
    """
    if dist.get_backend() == "gloo":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist.get_backend())


def main(cfg: RunConfig, compare_dispatchers: bool = False) -> dict[str, TrainResult]:
    """Entry point on every rank (``examples/deepspeed_moe.py``): train (or compare), print, free buffers."""
    validate(cfg, dist.get_world_size())
    init_deepspeed_comm()
    try:
        if compare_dispatchers:
            return compare(cfg)
        results = {cfg.dispatcher: train(cfg)}
        if dist.get_rank() == 0:
            print(format_table(cfg, results), flush=True)
        return results
    finally:
        destroy_buffers()
