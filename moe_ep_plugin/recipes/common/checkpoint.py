"""Checkpoints of every recipe: ``<root>/step_NNNNNNN/``, one part per rank, marked complete by rank 0.

Every rank writes its part (its own file ``rank_RRRRR.pt``, or whatever a writer puts there, e.g. DeepSpeed's
engine), then rank 0 writes ``meta.json`` (step, EP size, the recipe's config) and the ``COMPLETE`` marker, and
prunes old checkpoints. A directory without the marker (a run killed while saving) is never resumed from. The
trainer (``resume: auto``), the Megatron-Core launcher and the DeepSpeed example all save and find checkpoints here.
Before any rank starts, :func:`pick_resume` checks every file of the checkpoint to resume (and, when asked, falls
back to the newest complete one before it that passes); a write that fails (a full disk) leaves no file that looks
whole and raises one line naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ... import launch

COMPLETE = "COMPLETE"
META = "meta.json"


class DamagedCheckpoint(ValueError):
    """A file of a checkpoint is missing or unreadable; the message names it (one line, starting with the key)."""


class CheckpointWriteError(launch.OneLineError, OSError):
    """A checkpoint file could not be written (a full disk: ``errno.ENOSPC``); its message is the whole story."""

    def __str__(self) -> str:
        return str(self.strerror)


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
        raise DamagedCheckpoint(f"{key}: {directory} is not a complete checkpoint (no {COMPLETE} marker)")
    path = os.path.join(directory, META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedCheckpoint(_unreadable(key, directory, path, exc)) from exc
    if not isinstance(meta, dict) or not {"step", "world_size", "config"} <= meta.keys():
        raise DamagedCheckpoint(_unreadable(key, directory, path, ValueError("not a checkpoint's meta.json")))
    return meta


def verify(directory: str, key: str) -> dict[str, Any]:
    """Check every file of the checkpoint ``directory`` without loading it: the marker, ``meta.json``, and each
    rank's file present and whole (``torch.save`` writes a zip archive: its directory must read and every entry match
    its CRC). Returns the meta; raises :class:`DamagedCheckpoint` naming the first bad file."""
    meta = read_meta(directory, key)
    for rank in range(meta["world_size"]):
        path = rank_file(directory, rank)
        if not os.path.isfile(path):
            raise DamagedCheckpoint(
                f"{key}: checkpoint {os.path.basename(directory)}: {path} is missing (the file "
                f"of rank {rank}); remove {directory} to resume from the checkpoint before it"
            )
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except (OSError, zipfile.BadZipFile) as exc:
            raise DamagedCheckpoint(_unreadable(key, directory, path, exc)) from exc
        if bad is not None:
            raise DamagedCheckpoint(_unreadable(key, directory, path, ValueError(f"entry {bad} fails its CRC")))
    return meta


def pick_resume(directory: str | None, key: str, fallback_key: str, fallback: bool) -> tuple[str | None, str | None]:
    """The checkpoint to resume, checked by :func:`verify` before any rank starts: ``directory`` (None: none), or,
    with ``fallback`` (the setting ``fallback_key``) when it is damaged, the newest complete checkpoint before it
    that passes. Returns ``(directory, note)``; the note says what the fallback did (None without one). Raises
    :class:`DamagedCheckpoint` naming the file when nothing passes."""
    if directory is None:
        return None, None
    try:
        verify(directory, key)
        return directory, None
    except DamagedCheckpoint as exc:
        if not fallback:
            raise DamagedCheckpoint(
                f"{exc} ({fallback_key}: true resumes from the newest complete checkpoint "
                "before it that passes instead)"
            ) from exc
        skipped = [str(exc)]
    name = os.path.basename(os.path.normpath(directory))
    for older in reversed(complete_checkpoints(os.path.dirname(os.path.normpath(directory)))):
        if os.path.basename(older) >= name:
            continue
        try:
            verify(older, key)
        except DamagedCheckpoint as exc:
            skipped.append(str(exc))
            continue
        return (
            older,
            f"{fallback_key}: resuming from {older}, the newest complete checkpoint that passes the check; "
            f"skipped: {' | '.join(skipped)}",
        )
    raise DamagedCheckpoint(f"{skipped[0]}; {fallback_key}: no complete checkpoint before it passes the check")


def _unreadable(key: str, directory: str, path: str, exc: BaseException) -> str:
    """The one-line error of a damaged file of the checkpoint ``directory``: never train from it."""
    return (
        f"{key}: checkpoint {os.path.basename(directory)}: {path} is unreadable ({type(exc).__name__}: "
        f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}); remove {directory} to resume from the "
        "checkpoint before it"
    )


def check_matches(
    meta: dict[str, Any], directory: str, config: dict[str, Any], keys: Iterable[str], world: int, world_key: str
) -> None:
    """Raise ``ValueError`` naming the key when ``config`` (nested sections) differs from the checkpoint's in
    any of the dotted ``keys``, or the EP size does (expert shards cannot be re-split)."""
    if meta["world_size"] != world:
        raise ValueError(
            f"{world_key}: the checkpoint {directory} was saved by {meta['world_size']} ranks, this run "
            f"has {world} (expert shards cannot be re-split)"
        )
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


def save(
    root: str,
    step: int,
    config: dict[str, Any],
    group: dist.ProcessGroup | None = None,
    state: dict[str, Any] | None = None,
    write: Callable[[str], None] | None = None,
    keep: int = 0,
) -> str:
    """Collective: this rank's ``state`` goes to its file (or ``write(directory)`` writes its part), then rank 0
    marks the checkpoint complete and keeps only the newest ``keep`` (0: all). Returns the directory."""
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    directory = step_dir(root, step)
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, COMPLETE)
    if rank == 0 and os.path.exists(marker):  # a damaged checkpoint of this step, resumed past: rewritten unmarked
        os.remove(marker)
    dist.barrier(group)
    if state is not None:
        _write_atomic(rank_file(directory, rank), step, lambda tmp: torch.save(state, tmp))
    if write is not None:
        write(directory)
    dist.barrier(group)
    if rank == 0:
        text = json.dumps({"step": step, "world_size": world, "config": config}, indent=1)
        _write_atomic(os.path.join(directory, META), step, lambda tmp: _write_text(tmp, text))
        _write_atomic(marker, step, lambda tmp: _write_text(tmp, f"{world}\n"))
        if keep:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group)
    return directory


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _write_atomic(path: str, step: int, write: Callable[[str], None]) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``, so a failed write leaves no file that looks whole; on failure
    the temporary file is removed and :class:`CheckpointWriteError` names the step and the file (torch.save meets a
    full disk as a RuntimeError "unexpected pos", without an errno)."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        full = getattr(exc, "errno", None) == errno.ENOSPC or "unexpected pos" in str(exc)
        why = "no space left on device" if full else f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        code = errno.ENOSPC if full else getattr(exc, "errno", None) or errno.EIO
        raise CheckpointWriteError(code, f"checkpoint step {step}: {why} writing {path}") from exc


def load_rank_state(directory: str, key: str, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """This rank's file of a complete checkpoint (``key`` names the setting that chose it in errors)."""
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    read_meta(directory, key)
    path = rank_file(directory, rank)
    if not os.path.isfile(path):
        raise DamagedCheckpoint(f"{key}: {directory} has no file for rank {rank}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load raises many kinds (UnpicklingError, EOFError, RuntimeError) for a bad file
        raise DamagedCheckpoint(_unreadable(key, directory, path, exc)) from exc
