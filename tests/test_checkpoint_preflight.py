"""Checkpoints checked before any rank starts: every file of the one to resume (one line naming the file, exit code
2, no rank started), the fallback to the newest complete one that passes (an option, printed); a full disk while
saving: one line naming the file and "no space left on device", nothing half-written."""

from __future__ import annotations

import errno
import json
import os
import zipfile

import pytest
import torch

from moe_ep_plugin import launch
from moe_ep_plugin.recipes.common import checkpoint
from moe_ep_plugin.recipes.train import cli
from moe_ep_plugin.recipes.train.config import load

TINY = [
    "--set",
    "model.hidden_size=32",
    "--set",
    "model.num_layers=2",
    "--set",
    "model.num_heads=2",
    "--set",
    "model.ffn_hidden_size=48",
    "--set",
    "model.seq_len=16",
    "--set",
    "moe.num_experts=4",
    "--set",
    "moe.expert_ffn_hidden_size=16",
    "--set",
    "moe.num_groups=2",
    "--set",
    "moe.group_topk=1",
    "--set",
    "train.micro_batch_size=2",
    "--set",
    "parallel.device=cpu",
]


def _fake_checkpoint(root: str, step: int, config: dict, world: int = 2) -> str:
    """A complete checkpoint as ``checkpoint.save`` lays it out, written without ranks."""
    directory = checkpoint.step_dir(root, step)
    os.makedirs(directory)
    for rank in range(world):
        torch.save({"step": step, "rank": rank}, checkpoint.rank_file(directory, rank))
    with open(os.path.join(directory, checkpoint.META), "w", encoding="utf-8") as f:
        json.dump({"step": step, "world_size": world, "config": config}, f)
    with open(os.path.join(directory, checkpoint.COMPLETE), "w", encoding="ascii") as f:
        f.write(f"{world}\n")
    return directory


def _damage(path: str, how: str) -> None:
    if how == "missing":
        os.remove(path)
        return
    with open(path, "rb") as f:
        whole = f.read()
    with zipfile.ZipFile(path) as archive:  # where the first entry's stored bytes start
        first = archive.infolist()[0]
    at = (
        first.header_offset
        + 30
        + len(first.filename.encode())
        + int.from_bytes(whole[first.header_offset + 28 : first.header_offset + 30], "little")
    )
    with open(path, "wb") as f:
        if how == "truncated":
            f.write(whole[: len(whole) // 2])
        else:  # one flipped byte inside the stored data: the archive reads, its CRC does not match
            f.write(whole[:at] + bytes([whole[at] ^ 0xFF]) + whole[at + 1 :])


@pytest.mark.parametrize(
    "how, why",
    [
        ("missing", "is missing (the file of rank 1)"),
        ("truncated", "is unreadable (BadZipFile: "),
        ("flipped", "is unreadable (ValueError: entry "),
    ],
)
def test_verify_names_the_bad_file(tmp_path, how: str, why: str) -> None:
    directory = _fake_checkpoint(str(tmp_path), 4, {})
    assert checkpoint.verify(directory, "output.resume")["step"] == 4
    _damage(checkpoint.rank_file(directory, 1), how)
    with pytest.raises(checkpoint.DamagedCheckpoint) as info:
        checkpoint.verify(directory, "output.resume")
    assert str(info.value).startswith(
        f"output.resume: checkpoint step_0000004: {checkpoint.rank_file(directory, 1)} {why}"
    ), str(info.value)


def test_pick_resume_refuses_or_falls_back_and_says_so(tmp_path) -> None:
    good = _fake_checkpoint(str(tmp_path), 2, {})
    also_bad = _fake_checkpoint(str(tmp_path), 4, {})
    newest = _fake_checkpoint(str(tmp_path), 6, {})
    _damage(checkpoint.rank_file(newest, 0), "missing")
    _damage(checkpoint.rank_file(also_bad, 1), "truncated")
    with pytest.raises(checkpoint.DamagedCheckpoint) as info:
        checkpoint.pick_resume(newest, "k", "k_fallback", False)
    assert str(info.value) == (
        f"k: checkpoint step_0000006: {checkpoint.rank_file(newest, 0)} is missing (the file "
        f"of rank 0); remove {newest} to resume from the checkpoint before it (k_fallback: true "
        "resumes from the newest complete checkpoint before it that passes instead)"
    )
    found, note = checkpoint.pick_resume(newest, "k", "k_fallback", True)
    assert found == good
    assert (
        note.startswith(
            f"k_fallback: resuming from {good}, the newest complete checkpoint that passes the check; "
            f"skipped: k: checkpoint step_0000006: "
        )
        and " | k: checkpoint step_0000004: " in note
    )
    assert checkpoint.pick_resume(good, "k", "k_fallback", False) == (good, None)
    assert checkpoint.pick_resume(None, "k", "k_fallback", False) == (None, None)
    _damage(checkpoint.rank_file(good, 0), "flipped")
    with pytest.raises(checkpoint.DamagedCheckpoint, match=r"k_fallback: no complete checkpoint before it passes"):
        checkpoint.pick_resume(newest, "k", "k_fallback", True)


def _trainer_checkpoint(run: str) -> str:
    """A checkpoint of the TINY trainer config at step 2 (its files fake: the check reads no weights)."""
    cfg = load(None, tuple(o for o in TINY if o != "--set") + (f"output.dir={run}",))
    return _fake_checkpoint(os.path.join(run, "checkpoints"), 2, cfg.to_dict())


def test_the_trainer_refuses_a_damaged_checkpoint_before_any_rank(tmp_path, capsys, monkeypatch) -> None:
    run = str(tmp_path / "run")
    directory = _trainer_checkpoint(run)
    _damage(checkpoint.rank_file(directory, 1), "truncated")
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli.main([*TINY, "--set", f"output.dir={run}"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(
            f"moe-ep-train: config error: output.resume: checkpoint step_0000002: "
            f"{checkpoint.rank_file(directory, 1)} is unreadable (BadZipFile: "
        )
        and err.count("\n") == 1
    )


def test_the_trainer_falls_back_when_asked_and_prints_it(tmp_path, capsys, monkeypatch) -> None:
    run = str(tmp_path / "run")
    good = _trainer_checkpoint(run)
    cfg = load(None, tuple(o for o in TINY if o != "--set") + (f"output.dir={run}",))
    bad = _fake_checkpoint(os.path.join(run, "checkpoints"), 4, cfg.to_dict())
    _damage(checkpoint.rank_file(bad, 0), "missing")
    started = {}
    monkeypatch.setattr(launch, "run_ranks", lambda prog, fn, n, args, **k: started.update(cfg=args[0]) or 0)
    assert cli.main([*TINY, "--set", f"output.dir={run}", "--set", "output.resume_fallback=true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"moe-ep-train: output.resume_fallback: resuming from {good}, the newest complete "
        f"checkpoint that passes the check; skipped: output.resume: checkpoint step_0000004: "
    ), out
    assert started["cfg"].output.resume == good  # the ranks resume exactly the checkpoint checked


def _save_on_a_full_disk(root: str, where: str) -> None:
    """``checkpoint.save`` whose write of ``where`` (the rank file, or meta.json) meets ENOSPC after a partial write."""
    real_save, real_text = torch.save, checkpoint._write_text

    def full(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "rank":
        torch.save = lambda state, path: full(path)
    else:
        checkpoint._write_text = lambda path, text: full(path)
    try:
        with pytest.raises(checkpoint.CheckpointWriteError) as info:
            checkpoint.save(root, 5, {}, state={"w": torch.ones(2)})
    finally:
        torch.save, checkpoint._write_text = real_save, real_text
    directory = checkpoint.step_dir(root, 5)
    name = checkpoint.rank_file(directory, 0) if where == "rank" else os.path.join(directory, checkpoint.META)
    assert str(info.value) == f"checkpoint step 5: no space left on device writing {name}"
    assert info.value.errno == errno.ENOSPC
    left = sorted(os.listdir(directory))
    assert left == ([] if where == "rank" else ["rank_00000.pt"]), left  # no temporary file, no marker
    assert checkpoint.newest(root) is None


@pytest.mark.parametrize("where", ["rank", "meta"])
def test_a_full_disk_leaves_nothing_half_written(tmp_path, where: str) -> None:
    launch.spawn(_save_on_a_full_disk, 1, (str(tmp_path / "ckpt"), where), backend="gloo", timeout_s=30.0)


def test_a_full_disk_is_one_line_from_the_launcher(tmp_path, capfd) -> None:
    assert launch.run_ranks("prog", _full_disk_rank, 1, (str(tmp_path / "ckpt"),), backend="gloo") == 1
    err = capfd.readouterr().err
    name = checkpoint.rank_file(checkpoint.step_dir(str(tmp_path / "ckpt"), 5), 0)
    assert (
        err == f"prog: rank 0 failed: CheckpointWriteError: checkpoint step 5: no space left on device writing {name}\n"
    ), err


def _full_disk_rank(root: str) -> None:
    def full(state, path: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    torch.save = full  # this rank's process only
    checkpoint.save(root, 5, {}, state={"w": torch.ones(2)})
