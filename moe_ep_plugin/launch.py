"""Start N local ranks (one process each) when not under torchrun, or join torchrun's ranks.

Used by every front door (``moe-ep-train``, ``moe-ep-pretrain``, the DeepSpeed example) and by the multi-process
tests: one mechanism for all. When a spawned rank fails, the others get ``grace_s`` seconds to finish or fail on
their own, then SIGTERM, then SIGKILL (which also ends a stopped process), so a hung rank never hangs the job.
A failed rank prints nothing itself: it reports its exception to the launcher, and :func:`run_ranks` prints the
first failure's traceback (none for a :class:`OneLineError`) and one line per failed rank; a rank whose collective
failed only because a peer had failed before is named as that.
SIGTERM, SIGINT or SIGHUP to the launcher (``kill``, ``timeout``, Slurm's ``scancel``, ``docker stop``, Ctrl-C) is
forwarded to every rank; what is still running ``grace_s`` seconds later is killed, and the launcher raises
:class:`LaunchInterrupted` (:func:`run_ranks`: one line, exit code 128 + the signal's number).

Rendezvous: the launcher itself serves the ranks' TCPStore, listening on a port the kernel picked (port 0), and
passes the bound port to the ranks: no port is chosen first and bound later, so no other process can take it.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .config import DEFAULT_TIMEOUT_S, positive_int

GRACE_S = 5.0  # after the first failure: how long the other ranks may take to end on their own, then per signal
# How long the spawned ranks may take to start (a fresh interpreter importing torch, on a loaded machine) before
# the rendezvous gives up; ``timeout_s`` then bounds the group's own setup and every collective.
STARTUP_S = 900.0
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, store: dist.Store | None = None
) -> tuple[int, int]:
    """Initialise the default group from the environment (torchrun's, or :func:`spawn`'s with its ``store``);
    returns (rank, world)."""
    backend = backend or default_backend()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend: 'nccl' needs a GPU, but torch sees none (use gloo on the CPU)")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), store=store
        )
    return rank, world


class OneLineError(Exception):
    """An error whose message says all a user needs (a full disk, say): a rank failing with it gets its one line from
    the launcher, no traceback. Mixed into the error's own class, e.g. ``class E(OneLineError, OSError)``."""


# What a rank reports of its failure: a plain error, a OneLineError, or a collective that failed for want of a peer
PLAIN, ONE_LINE, LOST_PEER = "plain", "one_line", "lost_peer"


@dataclass
class RankFailure:
    """Why one spawned rank did not finish: ``reason`` is one line, ``details`` its traceback (may be empty),
    ``kind`` one of PLAIN, ONE_LINE, LOST_PEER, ``at`` when it failed (``time.time()``)."""

    rank: int
    reason: str
    details: str = ""
    kind: str = PLAIN
    at: float = 0.0

    def line(self, first: RankFailure) -> str:
        """This failure's line, ``first`` the job's first: a rank whose collective lost a peer after ``first`` failed
        is named as that (its own message, in ``details``, would blame a timeout it never waited for)."""
        if self is first or self.kind != LOST_PEER:
            return f"rank {self.rank} {self.reason}"
        error = self.reason.removeprefix("failed: ").split(":")[0]
        return (
            f"rank {self.rank} failed {max(0.0, self.at - first.at):.2f} s after rank {first.rank} did: its "
            f"collective lost the failed rank ({error})"
        )


class LaunchError(RuntimeError):
    """Some spawned ranks failed; ``failures`` lists them, the first to fail first. ``summary``: one line per failed
    rank; ``first_traceback``: the first failure's traceback ('' for a :class:`OneLineError` or none known)."""

    def __init__(self, nprocs: int, failures: list[RankFailure]) -> None:
        self.failures = failures
        self.summary = "\n".join(f.line(failures[0]) for f in failures)
        self.first_traceback = failures[0].details if failures[0].kind != ONE_LINE else ""
        details = "".join(f"--- rank {f.rank} ---\n{f.details}" for f in failures if f.details)
        super().__init__(
            f"{len(failures)} of {nprocs} ranks failed\n{self.summary}" + (f"\n{details}" if details else "")
        )


class LaunchInterrupted(KeyboardInterrupt):
    """The launcher got ``signum`` (SIGTERM, SIGINT or SIGHUP): it forwarded it to every rank and killed those
    still running ``grace_s`` seconds later (``killed`` lists them). A ``KeyboardInterrupt``, so that a caller of
    :func:`spawn` stops as the signal asked (a test session ends) instead of going on as after a failed call."""

    def __init__(self, signum: int, nprocs: int, killed: list[int]) -> None:
        self.signum, self.killed = signum, killed
        name = signal.Signals(signum).name
        self.summary = (
            f"interrupted by {name}: forwarded to the {nprocs} ranks"
            + (f", killed rank(s) {killed} still running after the grace" if killed else "")
            + "; no rank is left running"
        )
        super().__init__(self.summary)


class _Signalled(BaseException):
    """Raised in the launcher's main thread by its handler of a forwarded signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, _frame: object) -> None:
    raise _Signalled(signum)


def _set_handlers(handler: Any) -> dict[int, Any]:
    """Install ``handler`` for the forwarded signals; returns the handlers it replaced (none off the main thread,
    where Python cannot install any)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, handler) for signum in FORWARDED_SIGNALS}


def _entry(
    local_rank: int, world: int, port: int, backend: str, timeout_s: float, fn: Callable, args: tuple, report: Any
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        # The ranks share this host's cores: each takes its share of intra-op threads (torch's default is every
        # core per process; 4 ranks of small ops ran a soak round 3.7x slower so on a 2-core machine).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=STARTUP_S))
        # Every rank has started before the group forms: ``timeout_s`` then bounds the group's setup, not how long
        # the slowest interpreter took to import torch.
        store.set(f"started/{local_rank}", "1")
        store.wait([f"started/{r}" for r in range(world)], datetime.timedelta(seconds=STARTUP_S))
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        init_process_group(backend, timeout_s, store)
        # gloo's connectFullMesh can return on one rank while a peer is still connecting: a rank whose fn ends at
        # once would close its sockets under that peer's handshake ("Connection closed by peer"). Every rank starts
        # fn only once every rank's group is set up.
        store.set(f"joined/{local_rank}", "1")
        store.wait([f"joined/{r}" for r in range(world)])
        fn(*args)
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal: the launcher says it once
        report.send(("interrupted by SIGINT", "", PLAIN, time.time()))
        _leave(128 + signal.SIGINT)
    except BaseException as exc:  # tell the parent why (it prints the traceback), then fail this process
        report.send((f"{type(exc).__name__}: {exc}".splitlines()[0], traceback.format_exc(), _kind(exc), time.time()))
        failed = True
    else:
        failed = False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The rank's work is done. Leave without the interpreter's teardown: gloo's background threads can still be
    # joinable after a collective that timed out on a peer, and their C++ destructors then abort the process
    # ("terminate called without an active exception"), turning a finished rank into a SIGABRT.
    _leave(1 if failed else 0)


# gloo's words for a connection a peer closed, or a wait that ended
_LOST_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def _kind(exc: BaseException) -> str:
    """What a rank's failure was (see :class:`RankFailure`): a collective that lost a peer shows as a timeout, a
    torch.distributed error or a RuntimeError in gloo's words."""
    if isinstance(exc, OneLineError):
        return ONE_LINE
    if isinstance(exc, (TimeoutError, dist.DistError)) or (
        isinstance(exc, RuntimeError) and any(words in str(exc) for words in _LOST_PEER_WORDS)
    ):
        return LOST_PEER
    return PLAIN


def _interrupt_once(signum: int, frame: Any) -> None:
    """A rank's SIGINT handler: KeyboardInterrupt once, later SIGINTs ignored. Ctrl-C reaches the rank from the
    terminal and again forwarded by the launcher; a second KeyboardInterrupt inside the first one's handling would
    escape it as a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _state(pid: int) -> str:
    """The kernel's one-letter process state (``T``: stopped), or '' where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def spawn(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = GRACE_S,
) -> None:
    """Run ``fn(*args)`` on ``nprocs`` fresh local processes joined in one default process group.

    Returns when every rank finished. When one fails, the others are ended within about ``3 * grace_s``
    seconds and :class:`LaunchError` names each failed rank and why (its exception, exit code or signal, or
    that it was stopped or still running when ended). SIGTERM, SIGINT or SIGHUP to this process (from its main
    thread) is forwarded to every rank, those still running ``grace_s`` seconds later are killed, and
    :class:`LaunchInterrupted` is raised.
    """
    positive_int(nprocs, "nprocs")
    if not grace_s > 0:
        raise ValueError(f"grace_s: expected a positive number of seconds, got {grace_s!r}")
    ctx = mp.get_context("spawn")
    # Bound before any rank exists and held until every rank is gone: the port cannot be taken meanwhile.
    store = dist.TCPStore(
        "127.0.0.1", 0, nprocs, True, timeout=datetime.timedelta(seconds=STARTUP_S), wait_for_workers=False
    )
    pipes = [ctx.Pipe(duplex=False) for _ in range(nprocs)]
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, nprocs, store.port, backend or default_backend(), timeout_s, fn, args, pipes[r][1]),
            daemon=False,
        )
        for r in range(nprocs)
    ]
    reports: dict[int, tuple[str, str, str, float]] = {}
    failures: list[RankFailure] = []
    interrupted: LaunchInterrupted | None = None
    previous = _set_handlers(_raise_signalled)
    try:
        try:
            _run(procs, pipes, reports, failures, grace_s)
        except _Signalled as sig:
            _set_handlers(signal.SIG_IGN)  # the shutdown below is bounded; a second signal must not cut it short
            interrupted = LaunchInterrupted(sig.signum, nprocs, _forward(procs, sig.signum, grace_s))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:  # a signal can arrive before every rank was started
                p.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        del store
    if interrupted is not None:
        raise interrupted
    _collect(pipes, reports)
    _note_failures(procs, reports, failures)
    if failures:
        raise LaunchError(nprocs, failures)


def _run(
    procs: list,
    pipes: list,
    reports: dict[int, tuple[str, str, str, float]],
    failures: list[RankFailure],
    grace_s: float,
) -> None:
    """Start the ranks and wait until all have ended, or until ``grace_s`` after the first failure (then end the
    rest)."""
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()  # the child holds its own copy; EOF on the reader then means the child is gone
    deadline = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return
        # an exited rank's sentinel stays readable, so this list is never empty and wait() always returns
        readers = [pipes[r][0] for r in range(len(procs)) if r not in reports and not pipes[r][0].closed]
        wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
        multiprocessing.connection.wait(readers + [p.sentinel for p in alive], wait_s)
        _collect(pipes, reports)
        _note_failures(procs, reports, failures)
        if failures and deadline is None:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() >= deadline:
            failures += _end(procs, failures, grace_s)
            return


def _forward(procs: list, signum: int, grace_s: float) -> list[int]:
    """Send ``signum`` (with SIGCONT, so a stopped rank can act on it) to every started rank still running; SIGKILL
    those still running ``grace_s`` seconds later. Returns the killed ranks."""
    started = [(r, p) for r, p in enumerate(procs) if p.pid is not None and p.exitcode is None]
    for _, p in started:
        for sig in (signum, signal.SIGCONT):
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    limit = time.monotonic() + grace_s
    killed = []
    for r, p in started:
        p.join(max(0.0, limit - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            killed.append(r)
    return killed


def _collect(pipes: list, reports: dict[int, tuple[str, str, str, float]]) -> None:
    for r, (reader, _) in enumerate(pipes):
        if r not in reports and not reader.closed and reader.poll():
            try:
                reports[r] = reader.recv()
            except EOFError:
                reader.close()


def _note_failures(procs: list, reports: dict[int, tuple[str, str, str, float]], failures: list[RankFailure]) -> None:
    """Append the ranks that exited non-zero without a report and those that reported an exception. Seen together,
    the exits come first: a rank that dies without a word (a crash, ``os._exit``) resets its peers' connections,
    whose errors then arrive as reports of their own; reports seen together come in the order the ranks failed."""
    known = {f.rank for f in failures}
    for r, p in enumerate(procs):
        if r not in known and r not in reports and p.exitcode is not None and p.exitcode != 0:
            failures.append(RankFailure(r, _exit_reason(p.exitcode), at=time.time()))
            known.add(r)
    for r in sorted((r for r in reports if r not in known), key=lambda r: reports[r][3]):
        reason, details, kind, at = reports[r]
        failures.append(RankFailure(r, f"failed: {reason}", details, kind, at))


def _end(procs: list, failures: list[RankFailure], grace_s: float) -> list[RankFailure]:
    """SIGTERM (with SIGCONT, so a stopped rank can act on it), then SIGKILL, the ranks still running."""
    first, known = failures[0].rank, {f.rank for f in failures}
    ended, alive = [], [p for p in procs if p.exitcode is None]
    for r, p in enumerate(procs):
        if p.exitcode is None:
            stopped = _state(p.pid) == "T"
            if r not in known:
                why = "was stopped (SIGSTOP)" if stopped else "was still running"
                ended.append(
                    RankFailure(
                        r, f"{why} {grace_s:g} s after rank {first} failed; ended by the launcher", at=time.time()
                    )
                )
            p.terminate()
            if stopped:
                os.kill(p.pid, signal.SIGCONT)
    limit = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, limit - time.monotonic()))
        if p.exitcode is None:
            p.kill()
    return ended


def launch(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = GRACE_S,
) -> None:
    """Run ``fn(*args)`` on every rank: in this process under torchrun, else on ``nprocs`` spawned ones."""
    if under_torchrun():
        init_process_group(backend, timeout_s)
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
    else:
        spawn(fn, nprocs, args, backend, timeout_s, grace_s)


def run_ranks(
    prog: str,
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    grace_s: float = GRACE_S,
) -> int:
    """:func:`launch` for a command line: 0 when every rank finished, else 1 with the first failed rank's traceback
    (none for a :class:`OneLineError`) and one line per failed rank on stderr, or 128 + the signal's number with one
    line when the launcher was interrupted (:class:`LaunchInterrupted`)."""
    try:
        launch(fn, nprocs, args, backend, timeout_s, grace_s)
    except LaunchError as exc:
        lines = "\n".join(f"{prog}: {line}" for line in exc.summary.splitlines())
        print(f"{exc.first_traceback}{lines}", file=sys.stderr, flush=True)
        return 1
    except LaunchInterrupted as exc:
        print(f"{prog}: {exc.summary}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    return 0
