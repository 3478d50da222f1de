"""Plot a GPU run's kernel and Megatron-Core dispatcher timings next to DeepEP V1 and the targets.

Reads two benchmark console logs (see ``docs/gpu_testing.md``): the kernel benchmark
(``bench_dispatch_combine.py``: CUDA-graph rows ``graph kernel <op>`` at the standard shape and 24 SMs) and the
dispatcher harness (``mcore_dispatchers.py``: its ``kind | tokens | fwd us | fwd+bwd us`` table). DeepEP V1's
numbers on the same machine (2 x H200) and the targets are constants below.

Usage: ``python benchmarks/plot_results.py --kernels LOG --megatron LOG --out summary.png``
"""

from __future__ import annotations

import argparse
import re

# µs, EP2, 4096 tokens x 7168, top-8 of 256, 24 SMs: DeepEP V1 as measured on the same 2 x H200 host, and targets
KERNEL_OPS = [
    ("layout", "layout"),
    ("FP8 dispatch", "dispatch fp8"),
    ("BF16 dispatch", "dispatch bf16"),
    ("BF16 combine", "combine bf16"),
]
DEEPEP_US = {"layout": 41.0, "FP8 dispatch": 244.0, "BF16 dispatch": 344.0, "BF16 combine": 399.0}
KERNEL_TARGET_US = {"layout": 30.0, "FP8 dispatch": 160.0, "BF16 dispatch": 230.0, "BF16 combine": 260.0}
# ms, whole dispatcher path: (4096 fwd, 4096 fwd+bwd, 128 fwd)
DISPATCHER_TARGET_MS = (1.2, 3.0, 0.5)


def kernel_times(text: str, sms: int = 24, tokens: int = 4096) -> dict[str, float]:
    """``{op label: µs}`` from the CUDA-graph rows of the default nvlink configuration."""
    out = {}
    for label, op in KERNEL_OPS:
        pattern = rf"^nvlink {sms} SMs\s+{tokens} graph kernel {op}\s+([0-9.]+)"
        match = re.search(pattern, text, flags=re.MULTILINE)
        if match is None:
            raise ValueError(f"--kernels: no `graph kernel {op}` row for nvlink {sms} SMs, {tokens} tokens")
        out[label] = float(match.group(1))
    return out


def dispatcher_times(text: str) -> dict[str, dict[int, tuple[float, float]]]:
    """``{kind: {tokens: (fwd ms, fwd+bwd ms)}}`` from the harness's final table."""
    out: dict[str, dict[int, tuple[float, float]]] = {}
    for kind, tokens, fwd, both in re.findall(
        r"^(\S+)\s+\|\s+(\d+)\s+\|\s+([0-9.]+)\s+\|\s+([0-9.]+)\s+\|", text, flags=re.MULTILINE
    ):
        out.setdefault(kind, {})[int(tokens)] = (float(fwd) / 1e3, float(both) / 1e3)
    if not out:
        raise ValueError("--megatron: no `kind | tokens | fwd us | fwd+bwd us` table found")
    return out


def plot(
    kernels: dict[str, float], dispatchers: dict[str, dict[int, tuple[float, float]]], title: str, out: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [label for label, _ in KERNEL_OPS]
    xs = range(len(labels))
    width = 0.38
    left.bar([x - width / 2 for x in xs], [kernels[k] for k in labels], width, label="moe_ep_plugin (nvlink)")
    left.bar([x + width / 2 for x in xs], [DEEPEP_US[k] for k in labels], width, label="DeepEP V1", color="#bbbbbb")
    for x, k in zip(xs, labels, strict=True):
        left.hlines(
            KERNEL_TARGET_US[k],
            x - 0.45,
            x + 0.45,
            colors="crimson",
            linestyles="--",
            label="target" if x == 0 else None,
        )
        left.annotate(f"{kernels[k]:.0f}", (x - width / 2, kernels[k]), ha="center", va="bottom", fontsize=8)
    left.set_xticks(list(xs), labels)
    left.set_ylabel("GPU time per call (µs)")
    left.set_title("Kernels: EP2, 4096 tokens x 7168, top-8 of 256, 24 SMs")
    left.legend(fontsize=8)

    columns = [("4096 fwd", 4096, 0), ("4096 fwd+bwd", 4096, 1), ("128 fwd", 128, 0)]
    kinds = [k for k in dispatchers if all(t in dispatchers[k] for _, t, _ in columns)]
    width = 0.8 / max(len(kinds), 1)
    for i, kind in enumerate(kinds):
        values = [dispatchers[kind][tokens][which] for _, tokens, which in columns]
        right.bar([c + (i - (len(kinds) - 1) / 2) * width for c in range(len(columns))], values, width, label=kind)
    for c, target in enumerate(DISPATCHER_TARGET_MS):
        right.hlines(target, c - 0.45, c + 0.45, colors="crimson", linestyles="--", label="target" if c == 0 else None)
    right.set_xticks(range(len(columns)), [name for name, _, _ in columns])
    right.set_ylabel("whole dispatcher path (ms)")
    right.set_title("Megatron-Core dispatchers (identity experts)")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels", required=True, help="bench_dispatch_combine.py console log")
    p.add_argument("--megatron", required=True, help="mcore_dispatchers.py console log")
    p.add_argument("--title", default="2 x H200 (nvidia-h200-x2)")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    try:
        with open(args.kernels) as f:
            kernels = kernel_times(f.read())
        with open(args.megatron) as f:
            dispatchers = dispatcher_times(f.read())
    except ValueError as exc:
        p.error(str(exc))
    # What the figure shows, as text: the numbers a reader can check against the logs.
    for label, us in kernels.items():
        print(f"kernel {label}: {us} us")
    for kind, rows in dispatchers.items():
        for tokens, (fwd, both) in sorted(rows.items()):
            print(f"dispatcher {kind} {tokens}: fwd {fwd:.4f} ms, fwd+bwd {both:.4f} ms")
    plot(kernels, dispatchers, args.title, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
