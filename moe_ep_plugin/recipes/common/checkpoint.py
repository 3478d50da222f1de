"""Checkpoints of every recipe: ``<root>/step_NNNNNNN/``, one part per rank, marked complete by rank 0.

Every rank writes its part (its own file ``rank_RRRRR.pt``, or whatever a writer puts there, e.g. DeepSpeed's
engine), then rank 0 writes ``meta.json`` (step, EP size, the recipe's config) and the ``COMPLETE`` marker, and
prunes old checkpoints. A directory without the marker (a run killed while saving) is never resumed from. The
trainer (``resume: auto``), the Megatron-Core launcher and the DeepSpeed example all save and find checkpoints here.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
META = "meta.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.pt")


def check_writable(directory: str, key: str) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``directory`` is a directory this process can write in, or can be
    made (the run makes it later; this check makes nothing): a file is created in it, or in its nearest existing
    ancestor, and removed. Run before any rank starts, so a read-only or impossible output directory is one line,
    not a failure at the first checkpoint. Writing is the test because ``os.access`` answers yes to root on a
    read-only mount."""
    probe_in = os.path.abspath(directory)
    while not os.path.exists(probe_in):
        probe_in = os.path.dirname(probe_in)
    if not os.path.isdir(probe_in):
        raise ValueError(f"{key}: {directory!r} cannot be made: {probe_in} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".moe_ep_write_check_", dir=probe_in)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{key}: {directory!r} is not writable ({exc.strerror or exc} in {probe_in})") from exc


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith("step_"))
    return [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n, COMPLETE))]


def newest(root: str) -> str | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(directory: str, key: str) -> dict[str, Any]:
    """``meta.json`` of a complete checkpoint; ``key`` names the setting that chose it in the error."""
    if not os.path.isfile(os.path.join(directory, COMPLETE)):
        raise ValueError(f"{key}: {directory} is not a complete checkpoint (no {COMPLETE} marker)")
    path = os.path.join(directory, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(_unreadable(key, directory, path, exc)) from exc
    if not isinstance(meta, dict) or not {"step", "world_size", "config"} <= meta.keys():
        raise ValueError(_unreadable(key, directory, path, ValueError("not a checkpoint's meta.json")))
    return meta


def _unreadable(key: str, directory: str, path: str, exc: BaseException) -> str:
    """The one-line error of a damaged file of the checkpoint ``directory``: never train from it."""
    return (f"{key}: checkpoint {os.path.basename(directory)}: {path} is unreadable ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); remove {directory} to resume from the "
            "checkpoint before it")


def check_matches(meta: dict[str, Any], directory: str, config: dict[str, Any], keys: Iterable[str],
                  world: int, world_key: str) -> None:
    """Raise ``ValueError`` naming the key when ``config`` (nested sections) differs from the checkpoint's in
    any of the dotted ``keys``, or the EP size does (expert shards cannot be re-split)."""
    if meta["world_size"] != world:
        raise ValueError(f"{world_key}: the checkpoint {directory} was saved by {meta['world_size']} ranks, this run "
                         f"has {world} (expert shards cannot be re-split)")
    for key in keys:
        saved, current = meta["config"], config
        for part in key.split("."):
            saved, current = saved[part], current[part]
        if saved != current:
            raise ValueError(f"{key}: differs from the checkpoint {directory} ({saved!r} there, {current!r} here)")


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(root: str, step: int, config: dict[str, Any], group: dist.ProcessGroup | None = None,
         state: dict[str, Any] | None = None, write: Callable[[str], None] | None = None, keep: int = 0) -> str:
    """Collective: this rank's ``state`` goes to its file (or ``write(directory)`` writes its part), then rank 0
    marks the checkpoint complete and keeps only the newest ``keep`` (0: all). Returns the directory."""
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    directory = step_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    if state is not None:
        _write_state(state, rank_file(directory, rank), step)
    if write is not None:
        write(directory)
    dist.barrier(group)
    if rank == 0:
        with open(os.path.join(directory, META), "w", encoding="utf-8") as f:
            json.dump({"step": step, "world_size": world, "config": config}, f, indent=1)
        with open(os.path.join(directory, COMPLETE), "w", encoding="ascii") as f:
            f.write(f"{world}\n")
        if keep:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group)
    return directory


def _write_state(state: dict[str, Any], path: str, step: int) -> None:
    """``state`` to ``path`` through a temporary file renamed at the end, so a failed write leaves no file that
    looks whole; on failure the temporary file is removed and the error names the step and the file."""
    tmp = path + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        full = getattr(exc, "errno", None) == errno.ENOSPC or "unexpected pos" in str(exc)
        why = "no space left on device" if full else f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        raise OSError(getattr(exc, "errno", None) or errno.EIO, f"checkpoint step {step}: {why} writing {path}") \
            from exc


def load_rank_state(directory: str, key: str, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """This rank's file of a complete checkpoint (``key`` names the setting that chose it in errors)."""
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    read_meta(directory, key)
    path = rank_file(directory, rank)
    if not os.path.isfile(path):
        raise ValueError(f"{key}: {directory} has no file for rank {rank}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load raises many kinds (UnpicklingError, EOFError, RuntimeError) for a bad file
        raise ValueError(_unreadable(key, directory, path, exc)) from exc
