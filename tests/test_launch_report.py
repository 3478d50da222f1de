"""What the launcher prints when ranks fail: the first failure's traceback only (none for a ``launch.OneLineError``),
one line per failed rank, and a rank whose collective lost the failed rank named as that, with the time it took,
not with its own error's words (the torch transport's says "did not complete within 120 s" after 0.03 s)."""

from __future__ import annotations

import errno
import re

import torch
import torch.distributed as dist

from moe_ep_plugin import launch


class _DiskFull(launch.OneLineError, OSError):
    """A rank's error that says it all."""


def _rank_1_fails_at_once(one_line: bool) -> None:
    """Rank 1 fails before its first collective; rank 0 waits for it in one (120 s timeout)."""
    if dist.get_rank() == 1:
        if one_line:
            raise _DiskFull(errno.ENOSPC, "checkpoint step 4: no space left on device writing /x/rank_00001.pt")
        raise ValueError("moe.topk: rank 1 refuses")
    dist.all_reduce(torch.ones(1))


def _report_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("prog: ")]


def _peer_line_ok(line: str) -> bool:
    """Rank 0's line: it lost rank 1 in its collective, or was ended by the launcher (whichever came first)."""
    return (
        re.fullmatch(
            r"prog: rank 0 (failed \d+\.\d\d s after rank 1 did: its collective lost the failed rank "
            r"\(\w+\)|was still running 5 s after rank 1 failed; ended by the launcher)",
            line,
        )
        is not None
    )


def test_a_rank_failing_at_once_gives_its_traceback_and_one_line_per_rank(capfd) -> None:
    assert launch.run_ranks("prog", _rank_1_fails_at_once, 2, (False,), backend="gloo") == 1
    err = capfd.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1, err  # rank 1's only
    assert 'raise ValueError("moe.topk: rank 1 refuses")' in err
    lines = _report_lines(err)
    assert lines[0] == "prog: rank 1 failed: ValueError: moe.topk: rank 1 refuses", err
    assert len(lines) == 2 and _peer_line_ok(lines[1]), err
    assert "within" not in err, err


def test_a_one_line_error_prints_no_traceback(capfd) -> None:
    assert launch.run_ranks("prog", _rank_1_fails_at_once, 2, (True,), backend="gloo") == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines[0] == (
        "prog: rank 1 failed: _DiskFull: [Errno 28] checkpoint step 4: no space left on device writing /x/rank_00001.pt"
    ), err
    assert len(lines) == 2 and _peer_line_ok(lines[1]), err


def test_the_summary_names_a_peer_that_lost_the_failed_rank() -> None:
    first = launch.RankFailure(1, "failed: ValueError: moe.topk: bad", "Traceback ...\n", launch.PLAIN, 100.0)
    peer = launch.RankFailure(
        0,
        "failed: TimeoutError: moe_ep_plugin[torch] rank 0/3: dispatch did not complete within 120 s",
        "Traceback ...\n",
        launch.LOST_PEER,
        100.034,
    )
    ended = launch.RankFailure(2, "was still running 5 s after rank 1 failed; ended by the launcher", at=105.0)
    exc = launch.LaunchError(3, [first, peer, ended])
    assert exc.summary == (
        "rank 1 failed: ValueError: moe.topk: bad\n"
        "rank 0 failed 0.03 s after rank 1 did: its collective lost the failed rank (TimeoutError)\n"
        "rank 2 was still running 5 s after rank 1 failed; ended by the launcher"
    )
    assert exc.first_traceback == "Traceback ...\n"
    # a timeout that fails first is the cause itself: its own words
    assert launch.LaunchError(2, [peer]).summary == f"rank 0 {peer.reason}"
    one_line = launch.RankFailure(1, "failed: _DiskFull: full", "Traceback ...\n", launch.ONE_LINE, 1.0)
    assert launch.LaunchError(2, [one_line]).first_traceback == ""


def test_what_counts_as_a_lost_peer() -> None:
    assert launch._kind(TimeoutError("dispatch did not complete")) == launch.LOST_PEER
    assert launch._kind(dist.DistBackendError("NCCL error")) == launch.LOST_PEER
    assert (
        launch._kind(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:5"))
        == launch.LOST_PEER
    )
    assert launch._kind(RuntimeError("shape mismatch")) == launch.PLAIN
    assert launch._kind(ValueError("moe.topk: bad")) == launch.PLAIN
    assert launch._kind(_DiskFull(errno.ENOSPC, "full")) == launch.ONE_LINE
