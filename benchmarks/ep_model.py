"""EP model: dispatch and combine time at EP 2, 4 and 8 across GPUs, from what one GPU measures.

    python3 benchmarks/ep_model.py                  # predictions for the newest sweep of this code
    python3 benchmarks/ep_model.py --check          # the model's error on the one case measured across GPUs
    python3 benchmarks/ep_model.py --traffic        # memory traffic per remote byte: staged vs direct designs

A kernel at S SMs moves a rank's remote bytes B at the SM-bound throughput G the SM sweep measured with ranks sharing
one GPU (benchmarks/sm_sweep.py, rows ``sm_sweep`` in benchmarks/results.jsonl), after a fixed cost t0 (barrier,
launch, the last chunk's latency); across GPUs the link caps the throughput (``--link-gbs``, the measured remote-byte
rate of NVLink 4 per direction). From the sweep's two token counts (B1 < B2 at the same S):

    G = (B2 - B1) / (t2 - t1),  t0 = t2 - B2 / G,  t(EP, S) = t0 + B_EP / min(G, link)

where B_EP is the remote bytes one rank sends at that EP size (the standard shape's routing, as the sweep routes).
EP 8 takes the per-SM throughput measured at 4 ranks (the most a sweep on one GPU runs with 24 SMs each).

``--check`` runs the model on the sweep of commit ``abe3312``'s kernels and compares its EP 2 prediction with that
code's EP 2 kernel times measured across two H200s (rows ``bench_dispatch_combine``, ``timing: graph``, commit
``abe3312``): the error is printed; the model is trusted within 20 %. ``--record`` appends the predictions (kind
``predicted``): a prediction is not a measurement; the same sweep across GPUs replaces it when such a machine runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import records  # noqa: E402
import sm_sweep  # noqa: E402

# the sweep's kernels → the names of the EP 2 measurement across GPUs (bench_dispatch_combine, timing: graph)
MEASURED_OPS = {
    sm_sweep.KERNELS[0]: "FP8 dispatch, BF16 rows quantized in the send path",
    sm_sweep.KERNELS[1]: "FP8 dispatch, rows quantized beforehand",
    sm_sweep.KERNELS[2]: "BF16 dispatch",
    sm_sweep.KERNELS[3]: "BF16 combine",
}
BASELINE = "abe3312"
LINK_GBS = 380.0  # NVLink 4, one direction, remote bytes: copy-engine peer copy on 2 x H200 (shared/DEVICE.md)
TOLERANCE = 0.20


def remote_bytes(kernel: str, ep: int, tokens: int, hidden: int = 7168, seed: int = 1) -> int:
    """Bytes one rank sends to other ranks at EP ``ep`` (mean over ranks), as the sweep routes and counts them."""
    row = 2 * hidden if kernel in (sm_sweep.KERNELS[2], sm_sweep.KERNELS[3]) else hidden + hidden // 128 * 4
    total = 0
    for rank in range(ep):
        rows_to = sm_sweep.rows_to(sm_sweep.route(tokens, ep, seed * 1000 + rank), ep)
        total += sum(n for r, n in enumerate(rows_to) if r != rank)
    return total * row // ep


def load(path: str, benchmark: str, commit: str | None) -> list[dict]:
    """The newest rows of ``benchmark`` per configuration (of ``commit`` when given)."""
    newest: dict[str, dict] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["benchmark"] != benchmark or (commit and row["commit"] != commit):
                continue
            newest[json.dumps(row["configuration"], sort_keys=True)] = row
    return list(newest.values())


def fit(rows: list[dict], ranks: int) -> dict[tuple[str, int], tuple[float, float]]:
    """``(kernel, S) -> (t0 µs, G GB/s)`` from the sweep rows of ``ranks`` ranks sharing one GPU."""
    points: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for row in rows:
        c = row["configuration"]
        if c["ranks"] != ranks or c["kernel"].startswith("copy") or not row["plugin"]:
            continue
        b = remote_bytes(c["kernel"], ranks, c["tokens"])
        points.setdefault((c["kernel"], c["sms"]), []).append((b, b / row["plugin"] / 1e3))  # (bytes, µs)
    model = {}
    for key, pts in points.items():
        if len(pts) < 2:
            continue
        (b1, t1), (b2, t2) = sorted(pts)[0], sorted(pts)[-1]
        g = (b2 - b1) / (t2 - t1) / 1e3  # GB/s
        model[key] = (t2 - b2 / g / 1e3, g)
    return model


def predict(model: dict, kernel: str, sms: int, ep: int, tokens: int, link_gbs: float) -> float:
    t0, g = model[(kernel, sms)]
    return t0 + remote_bytes(kernel, ep, tokens) / min(g, link_gbs) / 1e3


def traffic(ep: int, tokens: int, seed: int = 1) -> dict[str, float]:
    """Memory traffic per remote byte, in units of a copy of it (one read, one write), at EP ``ep`` as the sweep
    routes (mean over ranks): ``staged`` a dispatch or combine whose remote rows pass a staging region (written
    there, then into the output, by SMs or copy engines), ``direct`` one writing rows straight into the receiver's
    output (reducing straight from the peers' expert outputs). Both also read each sent token once and write the
    rows a rank keeps; the combine's terms mirror the dispatch's (its outputs are the dispatched tokens)."""
    local = remote = sent = 0
    for rank in range(ep):
        in_rank = sm_sweep.token_ranks(sm_sweep.route(tokens, ep, seed * 1000 + rank), ep)
        local += int(in_rank[:, rank].sum())
        remote += int(in_rank.sum()) - int(in_rank[:, rank].sum())
        sent += int(in_rank.any(1).sum())
    base = sent + remote + local  # read each sent token, write every row where it lands
    return {"staged": (base + 2 * remote) / (2 * remote), "direct": base / (2 * remote)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=records.DEFAULT_PATH)
    p.add_argument("--commit", default=None, help="the sweep of this commit (default: the newest rows)")
    p.add_argument("--link-gbs", type=float, default=LINK_GBS)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--check", action="store_true", help=f"the error on {BASELINE}'s EP 2 kernel times")
    records.add_argument(p)
    p.add_argument("--traffic", action="store_true", help="copy units of memory traffic per remote byte, by design")
    args = p.parse_args()
    if args.traffic:
        print(f"Memory traffic per remote byte in copies of it, {args.tokens} tokens per rank (a count, not a time)")
        print("| EP | staged (today's kernels) | direct writes / reduce from peers |\n|---:|---:|---:|")
        for ep in (2, 4, 8):
            t = traffic(ep, args.tokens)
            print(f"| {ep} | {t['staged']:.2f} | {t['direct']:.2f} |")
        return
    if args.check:
        check(args)
        return
    rows = load(args.results, "sm_sweep", args.commit)
    if not rows:
        raise SystemExit(f"ep_model: no sm_sweep rows in {args.results}; run benchmarks/sm_sweep.py --record first")
    by_ranks = {2: fit(rows, 2), 4: fit(rows, 4)}
    print(
        f"Predicted kernel time (µs), {args.tokens} tokens per rank, link {args.link_gbs:.0f} GB/s per direction "
        "(a prediction from one GPU's SM sweep, not a measurement)"
    )
    print("| kernel | SMs | EP 2 | EP 4 | EP 8 |")
    print("|---|---:|---:|---:|---:|")
    for kernel, sms in sorted(by_ranks[2]):
        cells = []
        for ep in (2, 4, 8):
            model = by_ranks[2 if ep == 2 else 4]
            if (kernel, sms) not in model:
                cells.append("-")
                continue
            us = predict(model, kernel, sms, ep, args.tokens, args.link_gbs)
            cells.append(f"{us:.0f}")
            config = dict(ep=ep, tokens=args.tokens, kernel=kernel, sms=sms, link_gbs=args.link_gbs)
            records.record(args, "ep_model", config, round(us, 1), None, "µs", kind="predicted", device="model")
        print(f"| {kernel} | {sms} | {' | '.join(cells)} |")


def check(args: argparse.Namespace) -> None:
    sweep = load(args.results, f"sm_sweep, {BASELINE} kernels", BASELINE)
    measured = {
        r["configuration"]["op"]: r["plugin"]
        for r in load(args.results, "bench_dispatch_combine", BASELINE)
        if r["configuration"].get("timing") == "graph" and r["configuration"].get("ep") == 2
    }
    if not sweep:
        raise SystemExit(f"ep_model --check: no sweep of {BASELINE}'s kernels in {args.results}")
    model = fit(sweep, 2)
    print(
        f"EP 2, 4096 tokens, 24 SMs, link {args.link_gbs:.0f} GB/s: the model on {BASELINE}'s one-GPU sweep "
        f"against {BASELINE}'s kernel times measured across 2 x H200"
    )
    print("| kernel | predicted µs | measured µs | error |")
    print("|---|---:|---:|---:|")
    worst = 0.0
    for kernel, op in MEASURED_OPS.items():
        if (kernel, 24) not in model or op not in measured:
            print(f"| {kernel} | - | {measured.get(op, '-')} | - |")
            continue
        us = predict(model, kernel, 24, 2, 4096, args.link_gbs)
        error = us / measured[op] - 1
        worst = max(worst, abs(error))
        print(f"| {kernel} | {us:.0f} | {measured[op]:.0f} | {error:+.0%} |")
    verdict = "within" if worst <= TOLERANCE else "OUTSIDE"
    print(f"largest error {worst:.0%}: {verdict} the {TOLERANCE:.0%} the model is trusted to")
    if worst > TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
