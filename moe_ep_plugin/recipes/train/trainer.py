"""The training loop of one rank: data-parallel over the EP group for replicated weights, expert-parallel for
the routed experts.

Each rank feeds its own slice of the global batch. The loss a rank back-propagates is its local mean divided by
R, so the all-reduced (summed) gradients of the replicated weights, and the expert gradients that dispatch/combine
bring back from every rank, are both gradients of the global mean loss — the same numbers one rank holding all
experts computes on the whole batch (the EP=1 ≡ EP=R property the tests check).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from ... import gating
from ...buffer import Buffer
from ...buffer_cache import nvl_bytes_hint
from ...traffic import node_traffic
from ..common import checkpoint, progress, schedule
from ..common.data import TokenWindows, load_tokens
from . import metrics
from .config import TrainerConfig, validate
from .model import MoETransformer


def resolve_device(cfg: TrainerConfig) -> torch.device:
    want = cfg.parallel.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ValueError("parallel.device: 'cuda' requested but torch sees no GPU")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_backend(cfg: TrainerConfig) -> str:
    if cfg.parallel.backend != "auto":
        return cfg.parallel.backend
    return "nccl" if resolve_device(cfg).type == "cuda" else "gloo"


def preflight(cfg: TrainerConfig) -> str:
    """Checks that need this machine or files, not the values alone, done before any rank starts: a GPU for
    ``cuda``/``nccl``/``nvlink``, a corpus long enough for ``model.seq_len``, a checkpoint to resume whose every
    file is whole and that fits this config (pinned in ``output.resume``, so the ranks resume exactly the one
    checked; a fallback is printed). Returns the backend; raises ``ValueError`` naming the key."""
    p = cfg.parallel
    device = resolve_device(cfg)
    if p.backend == "nccl" and device.type != "cuda":
        raise ValueError("parallel.backend: 'nccl' moves CUDA tensors, but torch sees no GPU here (use auto or gloo)")
    if p.transport == "nvlink" and device.type != "cuda":
        raise ValueError(
            "parallel.transport: 'nvlink' runs CUDA kernels, but the ranks run on the CPU here (use auto or torch)"
        )
    TokenWindows(
        load_tokens(cfg.data.path, cfg.model.vocab_size), cfg.model.seq_len, cfg.data.eval_fraction, cfg.train.seed
    )
    if "WORLD_SIZE" in os.environ:  # under torchrun
        directory = resume_dir(cfg, int(os.environ["WORLD_SIZE"]), "WORLD_SIZE", check_files=True)
    else:
        directory = resume_dir(cfg, p.nprocs, "parallel.nprocs", check_files=True)
    if directory is not None:
        cfg.output.resume = directory
    return resolve_backend(cfg)


def resolve_dtype(cfg: TrainerConfig, device: torch.device) -> torch.dtype:
    if cfg.model.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.model.dtype)


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """Linear warm-up to ``train.lr``, then cosine decay to ``train.min_lr`` at ``train.steps``."""
    t = cfg.train
    return schedule.lr_at(step, t.lr, t.min_lr, t.warmup_steps, t.steps)


def checkpoint_root(cfg: TrainerConfig) -> str:
    return os.path.join(cfg.output.dir, "checkpoints")


# Keys a resumed run must share with the checkpoint for the loss trajectory to continue.
MUST_MATCH = ("model", "moe", "train.seed", "train.micro_batch_size", "data.path", "data.eval_fraction")


def resume_dir(cfg: TrainerConfig, world: int, world_key: str, check_files: bool = False) -> str | None:
    """The checkpoint ``output.resume`` asks for (None: start fresh), checked against this config and EP size;
    ``check_files``: every file of it checked first (``output.resume_fallback``: the newest good one before a
    damaged one, printed)."""
    if cfg.output.resume == "never":
        return None
    directory = checkpoint.newest(checkpoint_root(cfg)) if cfg.output.resume == "auto" else cfg.output.resume
    if check_files:
        directory, note = checkpoint.pick_resume(
            directory, "output.resume", "output.resume_fallback", cfg.output.resume_fallback
        )
        if note is not None:
            print(f"moe-ep-train: {note}", flush=True)
    if directory is not None:
        checkpoint.check_matches(
            checkpoint.read_meta(directory, "output.resume"), directory, cfg.to_dict(), MUST_MATCH, world, world_key
        )
    return directory


def _squared_norm(params: list[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            total += p.grad.double().square().sum()
    return total


@dataclass
class StepResult:
    """Global (all-rank) means of one forward/backward, and the global tokens per expert ``[blocks, E]``."""

    lm_loss: float
    aux_loss: float
    counts: torch.Tensor
    nodes: NodeStats | None = None  # when the EP group spans nodes

    @property
    def loss(self) -> float:
        return self.lm_loss + self.aux_loss


@dataclass
class NodeStats:
    """One step over all ranks and MoE blocks: nodes each token reaches (mean, max), and the bytes that cross the
    network (dispatch, combine and their backward passes) on the hierarchical transport and on a flat all-to-all."""

    nodes_per_token_mean: float
    nodes_per_token_max: int
    inter_node_bytes: float
    flat_inter_node_bytes: float


class Trainer:
    """One rank's model, optimizer, data and Buffer on ``group`` (the EP group, which is also the DP group)."""

    def __init__(self, cfg: TrainerConfig, group: dist.ProcessGroup | None = None) -> None:
        self.cfg = cfg
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        validate(cfg, world_size=self.world)
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        hidden_bytes = cfg.model.hidden_size * max(self.dtype.itemsize, 2)
        self.buffer = Buffer(
            self.group,
            num_nvl_bytes=nvl_bytes_hint(self.world, hidden_bytes),
            transport=cfg.parallel.transport,
            timeout_s=cfg.parallel.timeout_s,
            ranks_per_node=cfg.parallel.ranks_per_node,
        )
        # Node statistics when the group spans nodes (the hierarchical transport's, or the configured emulation).
        self.ranks_per_node = getattr(self.buffer.transport, "ranks_per_node", cfg.parallel.ranks_per_node)
        self.model = MoETransformer(cfg, self.rank, self.world)
        self.model.initialize(cfg.train.seed)
        self.model.to(self.device)
        self.model.attach(self.buffer)
        self.replicated = self.model.replicated_parameters()
        self.experts = self.model.expert_parameters()
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=1e-8,
        )
        self.data = TokenWindows(
            load_tokens(cfg.data.path, cfg.model.vocab_size), cfg.model.seq_len, cfg.data.eval_fraction, t.seed
        )
        self.flops_per_token = metrics.train_flops_per_token(cfg)
        self.peak_flops, self.peak_source = metrics.peak_flops(cfg, self.device, self.dtype)
        self.step = 0
        self.load_totals = torch.zeros(len(self.model.moe_layers()), cfg.moe.num_experts, dtype=torch.int64)

    # ------------------------------------------------------------------ one step, in pieces the tests reuse
    def batch(self, step: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        return self.data.batch(step, self.cfg.train.micro_batch_size, self.rank, self.world, self.device, split)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _global_mean(
        self, lm: torch.Tensor, aux: torch.Tensor, counts: torch.Tensor, routes: list[torch.Tensor]
    ) -> StepResult:
        """One all-reduce for the two losses, the expert counts (float64 holds counts exactly) and, across nodes,
        the node sums (plus one all-reduce for the most nodes a token reached)."""
        sums, most = self._node_sums(routes)
        packed = torch.cat(
            [
                torch.stack([lm.detach(), aux.detach()]).double(),
                sums.to(lm.device),
                counts.to(lm.device).double().flatten(),
            ]
        )
        dist.all_reduce(packed, group=self.group)
        nodes = None
        if most is not None:
            most = most.to(lm.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            nodes = NodeStats(float(packed[2] / packed[3].clamp_min(1)), int(most), float(packed[4]), float(packed[5]))
        return StepResult(
            lm_loss=float(packed[0]) / self.world,
            aux_loss=float(packed[1]) / self.world,
            counts=packed[2 + sums.numel() :].round().long().view_as(counts).cpu(),
            nodes=nodes,
        )

    def _node_sums(self, routes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's ``[nodes reached summed over tokens, tokens, hierarchical network bytes, flat network
        bytes]`` float64 over its MoE blocks, and the most nodes one token reached; empty and None on one node."""
        if self.ranks_per_node is None or self.ranks_per_node == self.world:
            return torch.zeros(0, dtype=torch.float64), None
        cfg = self.cfg
        h, elem, k = cfg.model.hidden_size, self.dtype.itemsize, cfg.moe.topk
        dispatch_row = (h + h // 128 * 4 if cfg.parallel.fp8_dispatch else h * elem) + (2 * k + 1) * 4
        row = dispatch_row + 3 * h * elem  # + combine, and the backward of both (rows in the compute dtype)
        sums, most = torch.zeros(4, dtype=torch.float64), 0
        for idx in routes:
            t = node_traffic(idx.cpu(), cfg.moe.num_experts, self.world, self.ranks_per_node, self.rank)
            sums += torch.tensor(
                [
                    t.nodes_per_token_mean * t.num_tokens,
                    t.num_tokens,
                    t.hier_network_rows * row,
                    t.flat_network_rows * row,
                ],
                dtype=torch.float64,
            )
            most = max(most, t.nodes_per_token_max)
        return sums, torch.tensor([most], dtype=torch.int64)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepResult:
        """Loss on this rank's ``inputs/targets [B, S]``, gradients of the global mean loss in every ``.grad``."""
        with self._autocast():
            logits, stats = self.model(inputs)
        lm = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        ((lm + stats.aux_loss) / self.world).backward()
        self._sum_replicated_grads()
        return self._global_mean(lm, stats.aux_loss, stats.counts, stats.routes)

    def _sum_replicated_grads(self) -> None:
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.replicated]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in self.replicated:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n

    def clip_gradients(self) -> torch.Tensor:
        """Global gradient norm (replicated weights once + every rank's experts), clipped to ``train.grad_clip``.
        Returns the norm as a 0-d float64 tensor on the device: neither the norm nor the clip decision is read on
        the host, so the optimizer step is queued behind the backward instead of waiting for it."""
        expert_sq = _squared_norm(self.experts, self.device)
        dist.all_reduce(expert_sq, group=self.group)
        norm = (_squared_norm(self.replicated, self.device) + expert_sq).sqrt()
        clip = self.cfg.train.grad_clip
        if clip > 0:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            # a factor of exactly 1.0 below the threshold leaves the gradients bit for bit as they are; float32 as
            # the gradients (parameters stay float32): the rounding a Python-float factor gets too, and the
            # scalar dtype the foreach kernels take on their fast path
            factor = torch.where(norm > clip, clip / (norm + 1e-6), 1.0).float()
            torch._foreach_mul_(grads, factor)
        return norm

    def optimizer_step(self, step: int, result: StepResult) -> torch.Tensor:
        """Clip, AdamW step at the scheduled LR, then the aux-loss-free bias update from the global loads.
        Returns the gradient norm before clipping (0-d tensor on the device, see :meth:`clip_gradients`)."""
        norm = self.clip_gradients()
        schedule.set_lr(self.optimizer, lr_at(self.cfg, step))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.cfg.moe.expert_bias:
            # one host-to-device copy for all blocks (each copy of pageable memory waits for the stream)
            counts = result.counts.to(self.device).float()
            for layer, layer_counts in zip(self.model.moe_layers(), counts, strict=True):
                gating.update_expert_bias(layer.expert_bias, layer_counts, self.cfg.moe.bias_update_rate)
        self.load_totals += result.counts
        return norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean LM loss over ``train.eval_batches`` fixed held-out batches (all ranks)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(self.cfg.train.eval_batches):
            inputs, targets = self.batch(i, "eval")
            with self._autocast():
                logits, _ = self.model(inputs)
            total += F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1)).double()
        dist.all_reduce(total, group=self.group)
        return float(total) / (self.world * self.cfg.train.eval_batches)

    # ------------------------------------------------------------------ the whole run
    def resume(self) -> str | None:
        directory = resume_dir(self.cfg, self.world, "parallel.nprocs")
        if directory is not None:
            state = checkpoint.load_rank_state(directory, "output.resume", self.group)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            checkpoint.set_rng_state(state["rng"])
            self.step, self.load_totals = state["step"], state["load_totals"]
        return directory

    def save(self) -> str:
        """Collective: this rank's model, optimizer, RNG, step and expert loads (see :mod:`.checkpoint`)."""
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": checkpoint.rng_state(),
            "load_totals": self.load_totals.cpu(),
        }
        return checkpoint.save(
            checkpoint_root(self.cfg),
            self.step,
            self.cfg.to_dict(),
            self.group,
            state=state,
            keep=self.cfg.output.keep_checkpoints,
        )

    def iter_steps(self, end: int) -> Iterator[dict[str, Any]]:
        """Train from ``self.step`` up to step ``end``, yielding each step's metrics row as it finishes: the
        columns of ``metrics.csv`` (``metrics.COLUMNS``), plus the node statistics when the group spans nodes.
        The step time covers forward, backward and the optimizer step only, so whatever the caller does between
        rows (logging, checkpoints) stays out of it; the evaluation due at a step runs after its timing too."""
        cfg = self.cfg
        tokens_per_step = self.world * cfg.train.micro_batch_size * cfg.model.seq_len
        start = time.perf_counter()
        while self.step < end:
            t0 = time.perf_counter()
            result = self.forward_backward(*self.batch(self.step))
            norm = self.optimizer_step(self.step, result)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.step += 1
            eval_loss = None
            if (
                self.data.has_eval
                and cfg.train.eval_interval
                and (self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps)
            ):
                eval_loss = self.evaluate()
            balance, worst = metrics.load_balance(result.counts)
            row = {
                "step": self.step,
                "loss": result.loss,
                "lm_loss": result.lm_loss,
                "aux_loss": result.aux_loss,
                "eval_loss": eval_loss,
                "lr": lr_at(cfg, self.step - 1),
                "grad_norm": float(norm),
                "tokens_per_s": tokens_per_step / dt,
                "step_time_s": dt,
                "load_max_over_mean": balance,
                "load_max_over_mean_worst_layer": worst,
                "elapsed_s": time.perf_counter() - start,
                "mfu": metrics.mfu(tokens_per_step / dt, self.world, self.flops_per_token, self.peak_flops),
            }
            if result.nodes is not None:
                row.update(
                    nodes_per_token_mean=result.nodes.nodes_per_token_mean,
                    nodes_per_token_max=result.nodes.nodes_per_token_max,
                    inter_node_mb=result.nodes.inter_node_bytes / 1e6,
                    flat_inter_node_mb=result.nodes.flat_inter_node_bytes / 1e6,
                )
            yield row

    def train(self, until: int | None = None) -> dict[str, float]:
        """Train from the resumed step to ``train.steps`` (or stop after step ``until``, checkpointing there, as a
        time-boxed job would); rank 0 writes the log, metrics.csv and plots. Returns the last metrics row."""
        cfg, lead = self.cfg, self.rank == 0
        out = cfg.output.dir
        if lead:
            os.makedirs(out, exist_ok=True)
        dist.barrier(self.group)
        metrics.use_thread_lock()
        logger = metrics.make_logger(out, to_console=lead) if lead else None
        resumed = self.resume()
        writer = metrics.MetricsWriter(out, self.step, cfg.output.tensorboard) if lead else None
        if lead:
            self.log_header(logger, resumed)
            if self.step >= cfg.train.steps:
                logger.info(f"nothing to train: the checkpoint is at train.steps={cfg.train.steps} (raise it to go on)")
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            disable=not (lead and cfg.output.progress_bar),
            unit="step",
            dynamic_ncols=True,
        )
        end = cfg.train.steps if until is None else min(until, cfg.train.steps)
        last: dict = {}
        for last in self.iter_steps(end):
            if lead:
                writer.write(last)
                bar.update(1)
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:,.0f}")
                if progress.due(self.step, end, cfg.output.log_interval) or last["eval_loss"] is not None:
                    logger.info(_format(last, cfg.train.steps))
            interval = cfg.output.checkpoint_interval
            if self.step == end or (interval and self.step % interval == 0):
                path = self.save()
                if lead:
                    logger.info(f"checkpoint saved: {path}")
        bar.close()
        if lead:
            writer.close()
            self._finish(logger, last)
        return last

    def log_header(self, logger: logging.Logger, resumed: str | None = None) -> None:
        """The run's first log lines: ranks, device, model, data, the MFU FLOPs per token and peak."""
        cfg = self.cfg
        n_rep = sum(p.numel() for p in self.replicated)
        n_exp = sum(p.numel() for p in self.experts)
        logger.info(
            f"moe-ep-train: {self.world} EP rank(s) on {self.device.type} ({dist.get_backend(self.group)}), "
            f"transport={self.buffer.transport_name}, compute dtype {str(self.dtype).replace('torch.', '')}, "
            f"FP8 dispatch {'on' if cfg.parallel.fp8_dispatch else 'off'}"
        )
        logger.info(
            f"model: {cfg.model.num_layers} blocks ({cfg.model.num_dense_layers} dense), hidden "
            f"{cfg.model.hidden_size}, {cfg.moe.num_experts} routed experts top-{cfg.moe.topk} "
            f"({cfg.moe.num_groups} groups, top-{cfg.moe.group_topk}) + {cfg.moe.num_shared_experts} shared; "
            f"params: {n_rep / 1e6:.2f}M replicated + {n_exp / 1e6:.2f}M experts per rank"
        )
        logger.info(
            f"data: {len(self.data.train):,} training tokens ({cfg.data.path or 'shipped corpus'}); "
            f"global batch {self.world * cfg.train.micro_batch_size} x {cfg.model.seq_len} tokens; "
            f"output in {cfg.output.dir}"
        )
        logger.info(
            f"MFU: {self.flops_per_token / 1e9:.3f} GFLOP per token per training step "
            f"(docs/training.md), peak per device {self.peak_source}; "
            f"moe.expert_compute={cfg.moe.expert_compute}"
        )
        if resumed:
            logger.info(f"resumed from {resumed} at step {self.step}")

    def _finish(self, logger, last: dict) -> None:
        metrics.write_expert_load(self.cfg.output.dir, self.load_totals, self.cfg.model.num_dense_layers)
        if self.cfg.output.plots:
            why_not = metrics.write_plots(self.cfg.output.dir)
            logger.info(
                f"plots skipped: {why_not}"
                if why_not
                else f"plots: {os.path.join(self.cfg.output.dir, 'loss.png')}, expert_load.png"
            )
        if last:
            logger.info(
                f"done: step {last['step']}, loss {last['loss']:.4f}, "
                f"{last['tokens_per_s']:,.0f} tokens/s at the last step; metrics in "
                f"{os.path.join(self.cfg.output.dir, 'metrics.csv')}"
            )


def _format(row: dict, total_steps: int) -> str:
    items = [
        f"loss {row['loss']:.4f} (aux {row['aux_loss']:.2e})",
        f"lr {row['lr']:.2e}",
        f"grad {row['grad_norm']:.3f}",
        f"{row['tokens_per_s']:,.0f} tok/s",
        f"load max/mean {row['load_max_over_mean']:.2f} (worst {row['load_max_over_mean_worst_layer']:.2f})",
    ]
    items.append("MFU n/a" if row["mfu"] is None else f"MFU {100 * row['mfu']:.1f}%")
    if "nodes_per_token_mean" in row:
        items += [
            f"nodes/token {row['nodes_per_token_mean']:.2f} (max {row['nodes_per_token_max']})",
            f"inter-node {row['inter_node_mb']:.2f} MB/step (flat all-to-all {row['flat_inter_node_mb']:.2f})",
        ]
    if row["eval_loss"] is not None:
        items.append(f"eval {row['eval_loss']:.4f}")
    return progress.line(row["step"], total_steps, items)


def share_cpu_cores(cfg: TrainerConfig) -> None:
    """On CPU, give each local rank its share of the host's cores (call once per rank, before training)."""
    if resolve_device(cfg).type == "cpu":
        # Ranks on one host share its cores; more threads than cores makes every rank wait on the slowest.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def run(cfg: TrainerConfig, until: int | None = None) -> None:
    """Per-rank entry point for ``launch.launch``: the default process group is already initialised."""
    share_cpu_cores(cfg)
    trainer = Trainer(cfg)
    try:
        trainer.train(until)
    finally:
        trainer.buffer.destroy()
