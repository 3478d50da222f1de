"""``moe-ep-pretrain CONFIG.yaml``: pretrain a DeepSeek-V3-style MoE GPT with Megatron-Core on this library.

One command: reads the YAML (:mod:`.yaml_config`), starts one process per rank (or joins torchrun's), sets up
Megatron's parallel state (TP x PP x EP from ``parallel:``), builds the model (:mod:`.model`), streams offline
byte-level data (``moe_ep_plugin.train.data``), and trains with AdamW (warmup + cosine), gradient clipping, the
aux-loss-free expert-bias update, progress logs, ``metrics.jsonl`` and per-rank checkpoints it can resume from.

Gradient reduction follows Megatron's rule: dense gradients are averaged over the data-parallel group; expert
gradients (parameters with ``allreduce=False``) are summed over the expert-data-parallel group and divided by the
same data-parallel size, since every rank's tokens already reached them through dispatch. One pipeline stage
(``pipeline_model_parallel_size: 1``): Megatron's pipeline schedules allocate on CUDA unconditionally.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .. import launch


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-ep-pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="pretraining YAML (see configs/megatron_*.yaml)")
    p.add_argument("--nprocs", type=int, default=None,
                   help="ranks to start when not under torchrun (default: TP x PP x EP of the YAML)")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--save-dir", default=None, help="override train.save_dir")
    return p


def _lr(step: int, train: Any) -> float:
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _flat_all_reduce(grads: list[torch.Tensor], group: Any) -> None:
    """Sum ``grads`` over ``group`` with one collective (flattened), writing the result back in place."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_gradients(model: torch.nn.Module) -> None:
    """Megatron's data-parallel gradient reduction (see module docstring), plus the sequence-parallel
    all-reduce of replicated (norm) weights over the TP group."""
    from megatron.core import parallel_state as ps
    params = [p for p in model.parameters() if p.grad is not None]
    if ps.get_tensor_model_parallel_world_size() > 1:
        _flat_all_reduce([p.grad for p in params if getattr(p, "sequence_parallel", False)],
                         ps.get_tensor_model_parallel_group())
    dense = [p.grad for p in params if getattr(p, "allreduce", True)]
    expert = [p.grad for p in params if not getattr(p, "allreduce", True)]
    _flat_all_reduce(dense, ps.get_data_parallel_group())
    _flat_all_reduce(expert, ps.get_expert_data_parallel_group())
    scale = 1.0 / ps.get_data_parallel_world_size()
    for g in dense + expert:
        g.mul_(scale)


def global_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm of the whole model's gradient: TP-split tensors summed over TP, experts over EP."""
    from megatron.core import parallel_state as ps
    device = next(model.parameters()).device
    dense_sq = torch.zeros((), dtype=torch.float32, device=device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    tp_rank = ps.get_tensor_model_parallel_rank()
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.float().pow(2).sum()
        if not getattr(p, "allreduce", True):
            expert_sq += sq
        elif getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            dense_sq += sq
    dist.all_reduce(dense_sq, group=ps.get_tensor_model_parallel_group())
    dist.all_reduce(expert_sq, group=ps.get_expert_model_parallel_group())
    return (dense_sq + expert_sq).sqrt()


def update_expert_bias(model: torch.nn.Module, rate: float) -> None:
    """Aux-loss-free balancing: nudge each router's expert bias toward the mean load (Megatron's update)."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from .model import moe_routers
    for router in moe_routers(model):
        if router.enable_expert_bias:
            with torch.no_grad():
                router.expert_bias.copy_(get_updated_expert_bias(router.local_tokens_per_expert, router.expert_bias,
                                                                 rate))
                router.local_tokens_per_expert.zero_()


def _checkpoint_file(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"iter_{step:07d}", f"rank_{rank:05d}.pt")


def save_checkpoint(directory: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its own shard; rank 0 then points ``latest`` at the step (a complete checkpoint)."""
    rank = dist.get_rank()
    path = _checkpoint_file(directory, step, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "world_size": dist.get_world_size(), "torch_rng": torch.get_rng_state()}, path)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(directory, "latest"), "w", encoding="utf-8") as f:
            f.write(str(step))


def load_checkpoint(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the step ``latest`` names; returns it (0 when the directory holds no checkpoint)."""
    marker = os.path.join(directory, "latest")
    if not os.path.isfile(marker):
        return 0
    with open(marker, encoding="utf-8") as f:
        step = int(f.read().strip())
    state = torch.load(_checkpoint_file(directory, step, dist.get_rank()), map_location="cpu", weights_only=False)
    if state["world_size"] != dist.get_world_size():
        raise ValueError(f"train.load_dir: checkpoint was written by {state['world_size']} ranks, this run has "
                         f"{dist.get_world_size()}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return step


def _optimizer(model: torch.nn.Module, train: Any) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=train.lr, betas=(train.adam_beta1, train.adam_beta2))


def _lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch (``inputs``/``targets`` ``[B, S]``)."""
    from .host import cuda_device_is_host
    seq = inputs.shape[1]
    positions = torch.arange(seq, device=inputs.device).unsqueeze(0).expand_as(inputs)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=inputs.device), 1)[None, None]
    with cuda_device_is_host():
        per_token = model(inputs, positions, causal, labels=targets)
    return per_token.float().mean()


def _run(path: str, overrides: dict[str, Any]) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from ..train.data import TokenWindows, load_tokens
    from .host import seed_model_parallel_rng
    from .model import build_gpt_model
    from .yaml_config import load_pretrain_config

    cfg = load_pretrain_config(path)
    cfg.train = dataclasses.replace(cfg.train, **overrides)
    train, par = cfg.train, cfg.parallel
    if par.get("pipeline_model_parallel_size", 1) != 1:
        raise ValueError("parallel.pipeline_model_parallel_size: the launcher runs one pipeline stage; use 1")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ps.initialize_model_parallel(par.get("tensor_model_parallel_size", 1), 1,
                                 expert_model_parallel_size=par.get("expert_model_parallel_size", 1),
                                 expert_tensor_parallel_size=par.get("expert_tensor_parallel_size"))
    seed_model_parallel_rng(train.seed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if train.global_batch_size % (train.micro_batch_size * dp):
        raise ValueError(f"train.global_batch_size={train.global_batch_size} must be a multiple of "
                         f"micro_batch_size x data-parallel size = {train.micro_batch_size * dp}")
    num_micro = train.global_batch_size // (train.micro_batch_size * dp)
    model = build_gpt_model(cfg, device)
    optimizer = _optimizer(model, train)
    data = TokenWindows(load_tokens(cfg.data.path, cfg.gpt.vocab_size), train.seq_length, cfg.data.eval_fraction,
                        cfg.data.seed)
    start = load_checkpoint(train.load_dir or train.save_dir, model, optimizer) if (
        train.load_dir or train.save_dir) else 0
    is_logger = dist.get_rank() == 0
    num_params = sum(p.numel() for p in model.parameters())
    if is_logger:
        print(f"moe-ep-pretrain: world {dist.get_world_size()} (TP {ps.get_tensor_model_parallel_world_size()}, EP "
              f"{ps.get_expert_model_parallel_world_size()}, DP {dp}), dispatcher "
              f"{cfg.transformer.moe_token_dispatcher_type}, {num_params / 1e6:.2f}M params on rank 0, "
              f"{num_micro} micro-batches/step, device {device.type}, from step {start}", flush=True)
    if train.save_dir:
        os.makedirs(train.save_dir, exist_ok=True)
    metrics = open(os.path.join(train.save_dir, "metrics.jsonl"), "a", encoding="utf-8") if (
        is_logger and train.save_dir) else None
    model.train()
    tokens_per_step = train.global_batch_size * train.seq_length
    t_last, logged, first_loss = time.perf_counter(), start, None
    for step in range(start, train.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, train)
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones((), device=device) / num_micro)
        loss_sum = torch.zeros((), device=device)
        for micro in range(num_micro):
            inputs, targets = data.batch(step * num_micro + micro, train.micro_batch_size, dp_rank, dp, device)
            loss = _lm_loss(model, inputs, targets)
            (loss / num_micro).backward()
            loss_sum += loss.detach()
        reduce_gradients(model)
        grad_norm = global_grad_norm(model)
        if train.clip_grad > 0:
            clip = torch.clamp(train.clip_grad / (grad_norm + 1e-6), max=1.0)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cfg.transformer.moe_router_enable_expert_bias:
            update_expert_bias(model, cfg.transformer.moe_router_bias_update_rate)
        dist.all_reduce(loss_sum, group=ps.get_data_parallel_group())
        step_loss = float(loss_sum) / (num_micro * dp)
        first_loss = step_loss if first_loss is None else first_loss
        done = step + 1
        if is_logger and (done % train.log_interval == 0 or done == train.steps or done == start + 1):
            now = time.perf_counter()
            rate = tokens_per_step * (done - logged) / (now - t_last)
            print(f"step {done:5d}/{train.steps} | loss {step_loss:.4f} | lr {_lr(step, train):.2e} | grad norm "
                  f"{float(grad_norm):.3f} | {rate:.0f} tok/s", flush=True)
            t_last, logged = now, done
        if metrics is not None:
            metrics.write(json.dumps({"step": done, "loss": step_loss, "lr": _lr(step, train),
                                      "grad_norm": float(grad_norm)}) + "\n")
            metrics.flush()
        if train.save_dir and train.save_interval and done % train.save_interval == 0:
            save_checkpoint(train.save_dir, done, model, optimizer)
    if train.save_dir and start < train.steps and not (train.save_interval and train.steps % train.save_interval == 0):
        save_checkpoint(train.save_dir, train.steps, model, optimizer)
    if data.has_eval and start < train.steps:
        model.eval()
        with torch.no_grad():
            inputs, targets = data.batch(0, train.micro_batch_size, dp_rank, dp, device, split="eval")
            eval_loss = _lm_loss(model, inputs, targets)
        dist.all_reduce(eval_loss, group=ps.get_data_parallel_group())
        if is_logger:
            print(f"done: first loss {first_loss:.4f}, last loss {step_loss:.4f}, eval loss "
                  f"{float(eval_loss) / dp:.4f}", flush=True)
    if is_logger and start >= train.steps:
        print(f"nothing to train: the checkpoint is at step {start} of {train.steps}", flush=True)
    if metrics is not None:
        metrics.close()
    ps.destroy_model_parallel()


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from .yaml_config import load_pretrain_config
    cfg = load_pretrain_config(args.config)  # validate before starting any rank
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.save_dir is not None:
        overrides["save_dir"] = args.save_dir
    par = cfg.parallel
    nprocs = args.nprocs or (par.get("tensor_model_parallel_size", 1) * par.get("pipeline_model_parallel_size", 1)
                             * par.get("expert_model_parallel_size", 1))
    launch.launch(_run, nprocs, args=(os.path.abspath(args.config), overrides), timeout_s=600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
