"""Checkpoints: one file per rank under ``<dir>/checkpoints/step_NNNNNNN/``, marked complete by rank 0.

Each rank saves its model state (replicated weights, its own experts, the expert biases), its optimizer state,
its RNG states, the step (which is also the data position: see ``data.TokenWindows``), the cumulative expert
loads and the config. A checkpoint directory without the ``COMPLETE`` marker (a run killed while saving) is
ignored by ``resume: auto``.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from .config import TrainerConfig

COMPLETE = "COMPLETE"
# Keys a resumed run must share with the checkpoint for the loss trajectory to continue.
_MUST_MATCH = ("model", "moe", "train.seed", "train.micro_batch_size", "data.path", "data.eval_fraction")


def checkpoint_root(cfg: TrainerConfig) -> str:
    return os.path.join(cfg.output.dir, "checkpoints")


def step_dir(cfg: TrainerConfig, step: int) -> str:
    return os.path.join(checkpoint_root(cfg), f"step_{step:07d}")


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, COMPLETE))]


def find_resume_dir(cfg: TrainerConfig) -> Optional[str]:
    """The checkpoint ``output.resume`` asks for: None (start fresh), the newest complete one, or a given one."""
    if cfg.output.resume == "never":
        return None
    if cfg.output.resume == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        return found[-1] if found else None
    if not os.path.isfile(os.path.join(cfg.output.resume, COMPLETE)):
        raise ValueError(f"output.resume: {cfg.output.resume} is not a complete checkpoint (no {COMPLETE} marker)")
    return cfg.output.resume


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(cfg: TrainerConfig, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         load_totals: torch.Tensor, group: dist.ProcessGroup) -> str:
    """Collective: every rank writes its file, then rank 0 marks the directory complete and prunes old ones."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    directory = step_dir(cfg, step)
    os.makedirs(directory, exist_ok=True)
    state = {"step": step, "world_size": world, "config": cfg.to_dict(), "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "rng": _rng_state(), "load_totals": load_totals.cpu()}
    tmp = _rank_file(directory, rank) + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, _rank_file(directory, rank))
    dist.barrier(group)
    if rank == 0:
        with open(os.path.join(directory, COMPLETE), "w") as f:
            f.write(f"{world}\n")
        keep = cfg.output.keep_checkpoints
        if keep:
            for old in complete_checkpoints(checkpoint_root(cfg))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group)
    return directory


def _lookup(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d[part]
    return d


def load(directory: str, cfg: TrainerConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         group: dist.ProcessGroup) -> tuple[int, torch.Tensor]:
    """Restore this rank's state from ``directory``; returns ``(step, load_totals)``. Raises ``ValueError``
    naming the key when the checkpoint was made with a different EP size or model."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    path = _rank_file(directory, rank)
    if not os.path.isfile(path):
        raise ValueError(f"output.resume: {directory} has no file for rank {rank}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["world_size"] != world:
        raise ValueError(f"parallel.nprocs: the checkpoint {directory} was saved with {state['world_size']} EP ranks, "
                         f"this run has {world} (expert shards cannot be re-split)")
    current = cfg.to_dict()
    for key in _MUST_MATCH:
        if _lookup(state["config"], key) != _lookup(current, key):
            raise ValueError(f"{key}: differs from the checkpoint {directory} "
                             f"({_lookup(state['config'], key)!r} there, {_lookup(current, key)!r} here)")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
    return state["step"], state["load_totals"]
