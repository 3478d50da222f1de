"""Soak: many random dispatch/combine rounds on 2-4 ranks, every round checked against a plain loop over tokens.

Run from the repository root:
    PYTHONPATH=. python3 benchmarks/soak.py --transport torch --ranks 2 --rounds 300          # CPU, gloo
    PYTHONPATH=. python3 benchmarks/soak.py --transport nvlink --device cuda:0 --ranks 4 --rounds 10000

Each round draws (alike on every rank, from ``seed + round``) the entry point (dispatch with top-k only, with the
layout, without top-k; a cached dispatch reusing an earlier round's handle; ``num_worst_tokens``; dispatch_experts
fresh and cached), the stream mode (sync, async, previous_event, both, allocate_on_comm_stream), the input form
(BF16, FP32, FP8 tuple, FP8 in the send path, with FP8 out), hidden size, top-k 1-8, experts per rank, tokens per
rank (0 included) and routing (random with -1 entries, sparse, all tokens to one expert); ``tests/support/rounds.py``
runs and checks it. With ``--device cuda:N`` the ranks share that GPU over a gloo group (``Buffer(device=...)``).
``--api elastic`` soaks the ``ElasticBuffer`` instead (``tests/support/elastic_rounds.py``): fresh and cached
dispatches, expanded and not, with weights, in DeepEP's stream modes, some with the current stream busy.
Prints rounds, mismatches (each with the seed that replays it: ``--seed S --rounds 1``) and seconds. ``--trace DIR``:
each rank writes every round's seed and description to ``DIR/rank<r>.log`` before running it, so a round that ends
the process (a kernel timeout traps) is named by the last line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

from support import elastic_rounds, rounds  # noqa: E402

from moe_ep_plugin import Buffer  # noqa: E402
from moe_ep_plugin.deep_ep import ElasticBuffer  # noqa: E402
from moe_ep_plugin.launch import spawn  # noqa: E402

# the most tokens a rank dispatches in an ElasticBuffer round
ELASTIC_MAX_TOKENS = 256


def _round(api: str, buffer, seed: int, world: int, state: rounds.State, rank: int):
    """``(round, its check)`` of ``seed`` for the Buffer's API or the ``ElasticBuffer``'s."""
    if api == "elastic":
        rnd = elastic_rounds.draw(seed, ELASTIC_MAX_TOKENS)
        return rnd, lambda: elastic_rounds.run(buffer, rnd, rank, world)
    rnd = rounds.draw(seed, world)
    return rnd, lambda: rounds.run(buffer, rnd, state, rank, world)


def _soak(
    api: str,
    transport: str,
    device: str | None,
    seed: int,
    num_rounds: int,
    timeout_s: float,
    max_seconds: float,
    out: str,
    trace: str | None,
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    # verdicts on a group of their own: a rank whose round raised before its peers' collectives ended must not meet
    # them inside the Buffer's (its peers time out, every rank reports the round)
    verdict_group = dist.new_group(backend="gloo")
    if api == "elastic":
        buffer = ElasticBuffer(
            dist.group.WORLD,
            num_max_tokens_per_rank=ELASTIC_MAX_TOKENS,
            hidden=1024,
            num_cpu_timeout_secs=int(timeout_s),
            transport=transport,
            device=device,
        )
    else:
        buffer = Buffer(transport=transport, timeout_s=timeout_s, device=device)
    state = rounds.State()
    failures: list[str] = []
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(
            total=num_rounds, desc=f"soak {api} {transport} x{world}", unit="round", file=sys.stderr, mininterval=10
        )
    start = time.monotonic()
    done = 0
    path = os.path.join(trace, f"rank{rank}.log") if trace else os.devnull
    with open(path, "w", buffering=1) as log:  # line-buffered: the last line survives a trap
        for i in range(num_rounds):
            # every rank stops at the same round: rank 0's clock decides, carried by the verdict exchange below
            rnd, check = _round(api, buffer, seed + i, world, state, rank)
            log.write(f"{seed + i} {rnd.describe()}\n")
            try:
                errors = check()
            except Exception as exc:  # a raise is a failure of the round, as a mismatch is
                errors = [f"raised {type(exc).__name__}: {exc}"]
                state = rounds.State()
            # every rank learns every rank's verdict, so all agree on the failures (and stay in step)
            verdicts: list = [None] * world
            stop = rank == 0 and time.monotonic() - start > max_seconds
            dist.all_gather_object(verdicts, (errors, stop), group=verdict_group)
            for r, (errs, _) in enumerate(verdicts):
                if errs:
                    failures.append(f"rank {r}: {rnd.describe()}: {'; '.join(errs)}")
            done += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(mismatches=len(failures), refresh=False)
            if verdicts[0][1]:
                break
    seconds = time.monotonic() - start
    if bar is not None:
        bar.close()
    if rank == 0:
        lines = [
            "| api | transport | ranks | device | rounds | mismatches | seconds | first seed |",
            "|---|---|---:|---|---:|---:|---:|---:|",
            f"| {api} | {transport} | {world} | {device or 'cpu'} | {done} | {len(failures)} | {seconds:.1f} "
            f"| {seed} |",
        ]
        lines += [f"MISMATCH {f}" for f in failures[:50]]
        print("\n".join(lines), flush=True)
        with open(out, "w") as f:
            f.write(f"{len(failures)}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--api",
        choices=("buffer", "elastic"),
        default="buffer",
        help="buffer: the V1 Buffer's entry points; elastic: ElasticBuffer fresh and cached dispatches "
        "with weights in DeepEP's stream modes",
    )
    p.add_argument("--transport", choices=("torch", "nvlink"), default="torch")
    p.add_argument("--device", default=None, help="cuda:N: ranks share that GPU (gloo group); default: CPU")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10000)
    p.add_argument("--seed", type=int, default=None, help="first round's seed (default: from the clock)")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument(
        "--max-seconds",
        type=float,
        default=float("inf"),
        help="stop after the round that passes this many seconds (the table says how many rounds ran)",
    )
    p.add_argument("--trace", default=None, metavar="DIR", help="each rank's rounds, written before each runs")
    args = p.parse_args()
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000 * 100000
    out = f"/tmp/moe_ep_soak_{os.getpid()}"
    spawn(
        _soak,
        args.ranks,
        args=(
            args.api,
            args.transport,
            args.device,
            seed,
            args.rounds,
            args.timeout_s,
            args.max_seconds,
            out,
            args.trace,
        ),
        backend="gloo",
        timeout_s=max(600.0, args.timeout_s * 2),
    )
    with open(out) as f:
        mismatches = int(f.read())
    os.remove(out)
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
