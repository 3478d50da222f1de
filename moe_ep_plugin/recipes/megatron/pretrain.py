"""``moe-ep-pretrain CONFIG.yaml``: pretrain a DeepSeek-V3-style MoE GPT with Megatron-Core on this library.

One command: reads the YAML (:mod:`.yaml_config`), starts one process per rank (or joins torchrun's), sets up
Megatron's parallel state (TP x PP x EP from ``parallel:``), builds the model (:mod:`.model`), streams offline
byte-level data (``moe_ep_plugin.recipes.common.data``), and trains with AdamW (warmup + cosine), gradient clipping, the
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
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import launch
from ...config import DEFAULT_TIMEOUT_S
from ..common import checkpoint, progress, schedule
from ..common.data import TokenWindows, load_tokens
from ..common.yaml_sections import config_error, read_yaml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-ep-pretrain", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="pretraining YAML (see configs/megatron_*.yaml)")
    p.add_argument(
        "--nprocs",
        type=int,
        default=None,
        help="ranks to start when not under torchrun (default: TP x PP x EP of the YAML)",
    )
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--save-dir", default=None, help="override train.save_dir")
    return p


def _lr(step: int, train: Any) -> float:
    return schedule.lr_at(step, train.lr, train.min_lr, train.warmup_steps, train.steps)


def _flat_all_reduce(grads: list[torch.Tensor], group: Any) -> None:
    """Sum ``grads`` over ``group`` with one collective (flattened), writing the result back in place."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_gradients(model: torch.nn.Module) -> None:
    """Megatron's data-parallel gradient reduction (see module docstring), plus the sequence-parallel
    all-reduce of replicated (norm) weights over the TP group."""
    from megatron.core import parallel_state as ps

    params = [p for p in model.parameters() if p.grad is not None]
    if ps.get_tensor_model_parallel_world_size() > 1:
        _flat_all_reduce(
            [p.grad for p in params if getattr(p, "sequence_parallel", False)], ps.get_tensor_model_parallel_group()
        )
    dense = [p.grad for p in params if getattr(p, "allreduce", True)]
    expert = [p.grad for p in params if not getattr(p, "allreduce", True)]
    _flat_all_reduce(dense, ps.get_data_parallel_group())
    _flat_all_reduce(expert, ps.get_expert_data_parallel_group())
    scale = 1.0 / ps.get_data_parallel_world_size()
    for g in dense + expert:
        g.mul_(scale)


def global_grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm of the whole model's gradient: TP-split tensors summed over TP, expert tensors over expert TP x EP
    (a tensor replicated over a TP group counted once), so every rank gets the same norm and clip factor."""
    from megatron.core import parallel_state as ps

    device = next(model.parameters()).device
    dense_sq = torch.zeros((), dtype=torch.float32, device=device)
    expert_sq = torch.zeros((), dtype=torch.float32, device=device)
    tp_rank = ps.get_tensor_model_parallel_rank()
    expert_tp_rank = ps.get_expert_tensor_parallel_rank()
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.float().pow(2).sum()
        split = getattr(p, "tensor_model_parallel", False)
        if not getattr(p, "allreduce", True):
            if split or expert_tp_rank == 0:
                expert_sq += sq
        elif split or tp_rank == 0:
            dense_sq += sq
    dist.all_reduce(dense_sq, group=ps.get_tensor_model_parallel_group())
    dist.all_reduce(expert_sq, group=ps.get_expert_tensor_and_model_parallel_group())
    return (dense_sq + expert_sq).sqrt()


def update_expert_bias(model: torch.nn.Module, rate: float) -> None:
    """Aux-loss-free balancing: nudge each router's expert bias toward the mean load (Megatron's update)."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    from .model import moe_routers

    for router in moe_routers(model):
        if router.enable_expert_bias:
            with torch.no_grad():
                router.expert_bias.copy_(
                    get_updated_expert_bias(router.local_tokens_per_expert, router.expert_bias, rate)
                )
                router.local_tokens_per_expert.zero_()


def save_checkpoint(
    directory: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]
) -> None:
    """Collective: every rank writes its own shard; rank 0 then marks the step complete
    (``recipes.common.checkpoint``)."""
    checkpoint.save(
        directory,
        step,
        config,
        state={
            "step": step,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": checkpoint.rng_state(),
        },
    )


def resume_checkpoint(train: Any, world: int, world_key: str) -> str | None:
    """Before any rank starts: the newest complete checkpoint under ``train.load_dir`` (else ``train.save_dir``),
    every file of it checked, saved by ``world`` ranks (``train.resume_fallback``: the newest good one before a
    damaged one, printed); None when there is none. Raises ``ValueError`` naming the key and the file."""
    root = train.load_dir or train.save_dir
    key = "train.load_dir" if train.load_dir else "train.save_dir"
    if train.load_dir and not os.path.isdir(train.load_dir):  # else the run would start fresh, silently
        raise ValueError(f"train.load_dir: no such directory {train.load_dir!r}")
    found, note = checkpoint.pick_resume(
        checkpoint.newest(root) if root else None, key, "train.resume_fallback", train.resume_fallback
    )
    if note is not None:
        print(f"moe-ep-pretrain: {note}", flush=True)
    if found is not None:
        checkpoint.check_matches(checkpoint.read_meta(found, key), found, {}, (), world, world_key)
    return found


def load_checkpoint(found: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore the checkpoint ``found`` (checked by :func:`resume_checkpoint`); returns its step."""
    state = checkpoint.load_rank_state(found, "train.load_dir")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    checkpoint.set_rng_state(state["rng"])
    return state["step"]


def _optimizer(model: torch.nn.Module, train: Any) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
    )


def _lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one micro-batch (``inputs``/``targets`` ``[B, S]``)."""
    from ...megatron.host import cuda_device_is_host

    seq = inputs.shape[1]
    positions = torch.arange(seq, device=inputs.device).unsqueeze(0).expand_as(inputs)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=inputs.device), 1)[None, None]
    with cuda_device_is_host():
        per_token = model(inputs, positions, causal, labels=targets)
    return per_token.float().mean()


def _run(path: str, overrides: dict[str, Any], resume: str | None) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from ...megatron import check_over_budget
    from ...megatron.host import seed_model_parallel_rng
    from .model import build_gpt_model
    from .yaml_config import load_pretrain_config

    cfg = load_pretrain_config(path)
    cfg.train = dataclasses.replace(cfg.train, **overrides)
    train, par = cfg.train, cfg.parallel
    saved_config = {"yaml": read_yaml(path), "overrides": overrides}
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ps.initialize_model_parallel(
        par.get("tensor_model_parallel_size", 1),
        1,
        expert_model_parallel_size=par.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=par.get("expert_tensor_parallel_size"),
    )
    seed_model_parallel_rng(train.seed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    num_micro = train.global_batch_size // (train.micro_batch_size * dp)
    model = build_gpt_model(cfg, device)
    optimizer = _optimizer(model, train)
    data = TokenWindows(
        load_tokens(cfg.data.path, cfg.gpt.vocab_size, "gpt.vocab_size"),
        train.seq_length,
        cfg.data.eval_fraction,
        cfg.data.seed,
    )
    start = load_checkpoint(resume, model, optimizer) if resume is not None else 0
    is_logger = dist.get_rank() == 0
    num_params = sum(p.numel() for p in model.parameters())
    if is_logger:
        print(
            f"moe-ep-pretrain: world {dist.get_world_size()} (TP {ps.get_tensor_model_parallel_world_size()}, EP "
            f"{ps.get_expert_model_parallel_world_size()}, DP {dp}), dispatcher "
            f"{cfg.transformer.moe_token_dispatcher_type}, {num_params / 1e6:.2f}M params on rank 0, "
            f"{num_micro} micro-batches/step, device {device.type}, from step {start}",
            flush=True,
        )
    if train.save_dir:
        os.makedirs(train.save_dir, exist_ok=True)
    metrics = (
        open(os.path.join(train.save_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if (is_logger and train.save_dir)
        else None
    )
    model.train()
    rate, first_loss = progress.TokenRate(train.global_batch_size * train.seq_length, start), None
    for step in range(start, train.steps):
        schedule.set_lr(optimizer, _lr(step, train))
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
        check_over_budget(model)  # ep_plugin's row budget: raises on every rank when pairs were dropped unasked
        if cfg.transformer.moe_router_enable_expert_bias:
            update_expert_bias(model, cfg.transformer.moe_router_bias_update_rate)
        dist.all_reduce(loss_sum, group=ps.get_data_parallel_group())
        step_loss = float(loss_sum) / (num_micro * dp)
        first_loss = step_loss if first_loss is None else first_loss
        done = step + 1
        if is_logger and progress.due(done, train.steps, train.log_interval, start):
            print(
                progress.line(
                    done,
                    train.steps,
                    [
                        f"loss {step_loss:.4f}",
                        f"lr {_lr(step, train):.2e}",
                        f"grad norm {float(grad_norm):.3f}",
                        f"{rate.mark(done):,.0f} tok/s",
                        *rate.pace(train.steps),
                    ],
                ),
                flush=True,
            )
        if metrics is not None:
            metrics.write(
                json.dumps({"step": done, "loss": step_loss, "lr": _lr(step, train), "grad_norm": float(grad_norm)})
                + "\n"
            )
            metrics.flush()
        if train.save_dir and train.save_interval and done % train.save_interval == 0:
            save_checkpoint(train.save_dir, done, model, optimizer, saved_config)
    if train.save_dir and start < train.steps and not (train.save_interval and train.steps % train.save_interval == 0):
        save_checkpoint(train.save_dir, train.steps, model, optimizer, saved_config)
    if data.has_eval and start < train.steps:
        model.eval()
        with torch.no_grad():
            inputs, targets = data.batch(0, train.micro_batch_size, dp_rank, dp, device, split="eval")
            eval_loss = _lm_loss(model, inputs, targets)
        dist.all_reduce(eval_loss, group=ps.get_data_parallel_group())
        if is_logger:
            print(
                f"done: first loss {first_loss:.4f}, last loss {step_loss:.4f}, eval loss {float(eval_loss) / dp:.4f}",
                flush=True,
            )
    if is_logger and start >= train.steps:
        print(f"nothing to train: the checkpoint is at step {start} of {train.steps}", flush=True)
    if metrics is not None:
        metrics.close()
    ps.destroy_model_parallel()


def check_world(cfg: Any, world: int, world_key: str) -> None:
    """The parallel layout and the batch must tile ``world`` ranks (``world_key`` names where it came from);
    raises ``ValueError`` naming the key before any rank starts."""
    par, train = cfg.parallel, cfg.train
    tp, ep = par.get("tensor_model_parallel_size", 1), par.get("expert_model_parallel_size", 1)
    etp = par.get("expert_tensor_parallel_size") or tp
    if world < 1 or world % tp:
        raise ValueError(f"{world_key}: {world} ranks are not a multiple of parallel.tensor_model_parallel_size={tp}")
    if world % (ep * etp):
        raise ValueError(
            f"{world_key}: {world} ranks are not a multiple of parallel.expert_model_parallel_size x "
            f"parallel.expert_tensor_parallel_size = {ep * etp}"
        )
    dp = world // tp
    if train.global_batch_size % (train.micro_batch_size * dp):
        raise ValueError(
            f"train.global_batch_size: {train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x data-parallel size = {train.micro_batch_size} x {dp}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .yaml_config import load_pretrain_config

    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.save_dir is not None:
        overrides["save_dir"] = args.save_dir
    try:  # everything the values alone decide, before any rank starts
        cfg = load_pretrain_config(args.config)
        cfg.train = dataclasses.replace(cfg.train, **overrides)
        if cfg.train.steps < 1:
            raise ValueError(f"--steps: must be >= 1, got {cfg.train.steps}")
        if cfg.plugin is not None and cfg.plugin.transport == "nvlink" and not torch.cuda.is_available():
            raise ValueError(
                "ep_plugin.transport: 'nvlink' runs CUDA kernels, but torch sees no GPU here (use auto or torch)"
            )
        par = cfg.parallel
        if launch.under_torchrun():
            nprocs, world_key = int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
        else:
            nprocs = args.nprocs or (
                par.get("tensor_model_parallel_size", 1) * par.get("expert_model_parallel_size", 1)
            )
            world_key = "--nprocs" if args.nprocs else "parallel (TP x EP)"
        check_world(cfg, nprocs, world_key)
        if cfg.train.save_dir:
            checkpoint.check_writable(cfg.train.save_dir, "--save-dir" if args.save_dir else "train.save_dir")
        TokenWindows(
            load_tokens(cfg.data.path, cfg.gpt.vocab_size, "gpt.vocab_size"),
            cfg.train.seq_length,
            cfg.data.eval_fraction,
            cfg.data.seed,
            "train.seq_length",
        )
        resume = resume_checkpoint(cfg.train, nprocs, world_key)
    except (TypeError, ValueError) as exc:
        return config_error("moe-ep-pretrain", exc)
    timeout_s = cfg.plugin.timeout_s if cfg.plugin is not None else DEFAULT_TIMEOUT_S
    return launch.run_ranks(
        "moe-ep-pretrain", _run, nprocs, (os.path.abspath(args.config), overrides, resume), timeout_s=timeout_s
    )


if __name__ == "__main__":
    raise SystemExit(main())
