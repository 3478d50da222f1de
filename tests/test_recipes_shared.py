"""The code all three recipes share: the learning-rate schedule, progress lines and checkpoints."""

from __future__ import annotations

import errno
import math
import os

import pytest
import torch
import torch.distributed as dist

from moe_ep_plugin import launch
from moe_ep_plugin.recipes.common import checkpoint, progress, schedule


def _reference_lr(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize(
    "lr, min_lr, warmup, steps", [(3e-3, 3e-4, 20, 300), (1.0, 0.0, 0, 10), (2.0, 2.0, 0, 5), (1.0, 0.1, 5, 5)]
)
def test_lr_schedule(lr, min_lr, warmup, steps) -> None:
    got = [schedule.lr_at(s, lr, min_lr, warmup, steps) for s in range(steps + 3)]
    assert got == [_reference_lr(s, lr, min_lr, warmup, steps) for s in range(steps + 3)]
    assert got[-1] == min_lr  # held after the last step
    if warmup:
        assert got[warmup - 1] == lr
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))], lr=9.0)
    schedule.set_lr(opt, got[1])
    assert [g["lr"] for g in opt.param_groups] == [got[1]]


def test_progress_due_and_line() -> None:
    assert [s for s in range(1, 31) if progress.due(s, 25, 10)] == [10, 20, 25, 30]
    assert [s for s in range(13, 31) if progress.due(s, 30, 10, start=12)] == [13, 20, 30]
    assert progress.line(7, 300, ["loss 1.0000", "lr 1.00e-03"]) == "step   7/300 | loss 1.0000 | lr 1.00e-03"
    rate = progress.TokenRate(100, step=0)
    assert rate.mark(4) > 0 and rate.step == 4
    rate.step_s = 1.5
    assert rate.pace(2404) == ["1,500 ms/step", "ETA 1:00:00"]


def _save_and_resume(root: str) -> None:
    rank = dist.get_rank()
    config = {"model": {"hidden": 8}, "train": {"seed": 1}}
    for step in (2, 4, 6):
        checkpoint.save(root, step, config, state={"step": step, "w": torch.full((3,), float(rank + step))}, keep=2)
    os.makedirs(checkpoint.step_dir(root, 8), exist_ok=True)  # a save that never finished: no COMPLETE marker
    assert [os.path.basename(d) for d in checkpoint.complete_checkpoints(root)] == ["step_0000004", "step_0000006"]
    newest = checkpoint.newest(root)
    state = checkpoint.load_rank_state(newest, "output.resume")
    assert state["step"] == 6 and torch.equal(state["w"], torch.full((3,), float(rank + 6)))
    meta = checkpoint.read_meta(newest, "output.resume")
    assert meta == {"step": 6, "world_size": 2, "config": config}
    checkpoint.check_matches(meta, newest, config, ("model", "train.seed"), 2, "parallel.nprocs")
    with pytest.raises(ValueError, match=r"^train.seed: differs from the checkpoint .* \(1 there, 2 here\)"):
        checkpoint.check_matches(meta, newest, {**config, "train": {"seed": 2}}, ("train.seed",), 2, "x")
    with pytest.raises(ValueError, match=r"^parallel.nprocs: the checkpoint .* saved by 2 ranks, this run has 4"):
        checkpoint.check_matches(meta, newest, config, (), 4, "parallel.nprocs")
    with pytest.raises(ValueError, match=r"^output.resume: .*step_0000008 is not a complete checkpoint"):
        checkpoint.load_rank_state(checkpoint.step_dir(root, 8), "output.resume")
    dist.barrier()


def test_checkpoints_save_prune_and_resume(tmp_path) -> None:
    launch.spawn(_save_and_resume, 2, (str(tmp_path / "ckpt"),), backend="gloo", timeout_s=30.0)


def _damaged(root: str) -> None:
    config = {"model": {"hidden": 8}}
    directory = checkpoint.save(root, 3, config, state={"w": torch.ones(4)})
    path = checkpoint.rank_file(directory, 0)
    for damage in (lambda b: b[: len(b) // 2], lambda b: b"garbage" * 9):  # a truncated file; garbage bytes
        with open(path, "rb") as f:
            whole = f.read()
        with open(path, "wb") as f:
            f.write(damage(whole))
        with pytest.raises(
            ValueError,
            match=r"^output.resume: checkpoint step_0000003: .*rank_00000.pt is unreadable "
            r"\(.*\); remove .*step_0000003 to resume from the checkpoint before it$",
        ):
            checkpoint.load_rank_state(directory, "output.resume")
        with open(path, "wb") as f:
            f.write(whole)
    assert torch.equal(checkpoint.load_rank_state(directory, "output.resume")["w"], torch.ones(4))
    meta = os.path.join(directory, checkpoint.META)
    for text in ('{"step": 3, "world', '["not", "a", "meta"]'):  # cut short; valid JSON of the wrong shape
        with open(meta, "w", encoding="utf-8") as f:
            f.write(text)
        with pytest.raises(ValueError, match=r"^output.resume: checkpoint step_0000003: .*meta.json is unreadable"):
            checkpoint.read_meta(directory, "output.resume")


def test_a_damaged_checkpoint_is_refused_naming_its_file_and_step(tmp_path) -> None:
    launch.spawn(_damaged, 1, (str(tmp_path / "ckpt"),), backend="gloo", timeout_s=30.0)


def _disk_full(root: str) -> None:
    def full(state, path):  # what torch.save meets on a full disk, after writing part of the file
        with open(path, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs 1024")

    torch.save, real = full, torch.save
    try:
        with pytest.raises(
            checkpoint.CheckpointWriteError,
            match=r"^checkpoint step 5: no space left on device "
            r"writing .*step_0000005/rank_00000.pt$",
        ) as info:
            checkpoint.save(root, 5, {}, state={"w": torch.ones(2)})
        assert info.value.errno == errno.ENOSPC and isinstance(info.value, launch.OneLineError)
    finally:
        torch.save = real
    directory = checkpoint.step_dir(root, 5)
    assert os.listdir(directory) == [] and checkpoint.newest(root) is None  # no temp file, nothing complete


def test_a_full_disk_names_the_step_and_file_and_leaves_no_temp_file(tmp_path) -> None:
    launch.spawn(_disk_full, 1, (str(tmp_path / "ckpt"),), backend="gloo", timeout_s=30.0)


def test_check_writable_probes_without_making_anything(tmp_path) -> None:
    nested = tmp_path / "a" / "b"
    checkpoint.check_writable(str(nested), "output.dir")  # makeable: fine, and nothing is left behind
    assert os.listdir(tmp_path) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    for path in (blocker, blocker / "sub", blocker / "sub" / "deeper"):
        with pytest.raises(
            ValueError,
            match=rf"^train.save_dir: '{path}' cannot be made: {blocker} is not a "
            "directory$",
        ):
            checkpoint.check_writable(str(path), "train.save_dir")
