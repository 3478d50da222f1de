"""Launch and front-door faults: a failed or hung spawned rank ends the job within a bound, naming the rank and
why; config errors are one line naming the key, exit code 2, before any rank starts (all three front doors)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from moe_ep_plugin import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stop_rank_1() -> None:
    """Rank 1 stops itself (SIGSTOP) before the collective; rank 0 times out waiting for it."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))


def _fail_rank_0_while_rank_1_sleeps() -> None:
    if dist.get_rank() == 0:
        raise ValueError("moe.topk: rank 0 refuses")
    time.sleep(600)


def _fail_on(rank: int) -> None:
    if dist.get_rank() == rank:
        os._exit(3)  # no exception, no report: the exit code is all the launcher sees
    dist.barrier()


def test_a_stopped_rank_is_ended_and_named_within_a_bound() -> None:
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(_stop_rank_1, 2, backend="gloo", timeout_s=3.0, grace_s=1.0)
    elapsed = time.monotonic() - start
    failures = {f.rank: f.reason for f in info.value.failures}
    assert sorted(failures) == [0, 1]
    assert info.value.failures[0].rank == 0  # the rank that failed first comes first
    assert failures[0].startswith("failed: RuntimeError: ") and "Timed out waiting 3000ms" in failures[0]
    assert failures[1] == "was stopped (SIGSTOP) 1 s after rank 0 failed; ended by the launcher"
    assert elapsed < 60, f"the launcher took {elapsed:.0f} s"


def test_a_failed_rank_ends_a_sleeping_one() -> None:
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(_fail_rank_0_while_rank_1_sleeps, 2, backend="gloo", grace_s=1.0)
    assert time.monotonic() - start < 60
    assert [(f.rank, f.reason) for f in info.value.failures] == [
        (0, "failed: ValueError: moe.topk: rank 0 refuses"),
        (1, "was still running 1 s after rank 0 failed; ended by the launcher")]
    assert "Traceback" in info.value.failures[0].details
    assert str(info.value).startswith("2 of 2 ranks failed\nrank 0 failed: ValueError: moe.topk: rank 0 refuses\n")


@pytest.mark.parametrize("world", [1, 3])
def test_a_rank_exiting_without_a_report_is_named_by_its_exit_code(world: int) -> None:
    with pytest.raises(launch.LaunchError) as info:
        launch.spawn(_fail_on, world, args=(world - 1,), backend="gloo", timeout_s=5.0, grace_s=1.0)
    first = info.value.failures[0]
    assert (first.rank, first.reason) == (world - 1, "exited with code 3")
    assert {f.rank for f in info.value.failures} <= set(range(world))


def test_run_ranks_exits_1_with_one_line_per_failed_rank(capfd) -> None:
    code = launch.run_ranks("prog", _fail_rank_0_while_rank_1_sleeps, 2, backend="gloo")
    err = capfd.readouterr().err
    assert code == 1
    assert "prog: rank 0 failed: ValueError: moe.topk: rank 0 refuses\n" in err
    assert "prog: rank 1 was still running" in err


def test_spawn_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="nprocs"):
        launch.spawn(_fail_on, 0)
    with pytest.raises(ValueError, match="grace_s"):
        launch.spawn(_fail_on, 1, grace_s=0)
