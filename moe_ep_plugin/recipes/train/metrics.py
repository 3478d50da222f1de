"""Rank 0's outputs: the readable log, metrics.csv (+ TensorBoard), and the PNG plots at the end."""

from __future__ import annotations

import csv
import logging
import os
import sys
import threading

import torch
from tqdm import tqdm

from .config import TrainerConfig

COLUMNS = (
    "step",
    "loss",
    "lm_loss",
    "aux_loss",
    "eval_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "load_max_over_mean",
    "load_max_over_mean_worst_layer",
    "elapsed_s",
    "mfu",
)

# Dense BF16 tensor-core peak per device from the vendor datasheets (H200 SXM has the H100 SXM's compute); MFU
# is reported against these, the usual convention. A measured 8192^3 BF16 matmul on one H200 reaches ~790 TFLOP/s.
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}


def use_thread_lock() -> None:
    """Give tqdm a thread lock. Its default lock holds a multiprocessing semaphore, which a rank leaving through
    ``os._exit`` (``launch.spawn``) never releases, so the launcher's resource tracker warned of leaked semaphores
    at shutdown; every rank's bar and log lines are written by that rank's own process, so a thread lock serves."""
    tqdm.set_lock(threading.RLock())


class _TqdmHandler(logging.Handler):
    """Log lines printed above the progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stdout)


def make_logger(out_dir: str, to_console: bool) -> logging.Logger:
    """``moe_ep_plugin.train`` logger: ``<out_dir>/train.log`` plus the console (above the tqdm bar)."""
    logger = logging.getLogger("moe_ep_plugin.train")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    fmt = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
    file_handler = logging.FileHandler(os.path.join(out_dir, "train.log"))
    file_handler.setFormatter(fmt)
    logger.addHandler(file_handler)
    if to_console:
        console = _TqdmHandler()
        console.setFormatter(fmt)
        logger.addHandler(console)
    return logger


def train_flops_per_token(cfg: TrainerConfig) -> float:
    """Model FLOPs of one training step per token: 3 x the forward (backward = 2 x forward), 2 FLOPs per
    multiply-add, counting the matmuls a token takes part in: attention projections ``4 H^2`` and causal scores
    ``2 S H`` (QK^T and AV over on average S/2 keys) per block, each dense MLP ``3 H F``, each MoE block's router
    ``E H``, shared experts ``3 H F_e n_shared`` and ``K`` routed experts ``3 H F_e`` each, and the LM head ``H V``.
    Norms, softmax and elementwise work are left out."""
    m, e = cfg.model, cfg.moe
    h, blocks, moe_blocks = m.hidden_size, m.num_layers, m.num_layers - m.num_dense_layers
    weights = blocks * 4 * h * h + m.num_dense_layers * 3 * h * m.ffn_hidden_size + h * m.vocab_size
    weights += moe_blocks * (e.num_experts * h + 3 * h * e.expert_ffn_hidden_size * (e.num_shared_experts + e.topk))
    forward = 2 * weights + blocks * 2 * m.seq_len * h
    return 3.0 * forward


def peak_flops(cfg: TrainerConfig, device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for MFU and where it came from: ``output.peak_tflops`` when set, else the
    datasheet dense BF16 figure of a known GPU computing in BF16, else None (MFU not reported)."""
    if cfg.output.peak_tflops is not None:
        return cfg.output.peak_tflops * 1e12, f"{cfg.output.peak_tflops:g} TFLOP/s (output.peak_tflops)"
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for model, tflops in DATASHEET_BF16_TFLOPS.items():
            if model in name:
                return tflops * 1e12, f"{tflops:g} TFLOP/s ({name} dense BF16 datasheet)"
        return None, f"n/a (no datasheet peak for {name}; set output.peak_tflops)"
    return None, f"n/a (no peak known for {device.type} {str(dtype).replace('torch.', '')}; set output.peak_tflops)"


def mfu(tokens_per_s: float, num_devices: int, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s per device over its peak (None without a peak)."""
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (num_devices * peak)


def load_balance(counts: torch.Tensor) -> tuple[float, float]:
    """``counts [layers, E]`` tokens per expert → (mean over layers, worst layer) of max load / mean load
    (1.0 = perfectly balanced; E/K when every token picks the same K experts)."""
    if counts.numel() == 0:
        return 1.0, 1.0
    counts = counts.double()
    ratio = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
    return float(ratio.mean()), float(ratio.max())


class MetricsWriter:
    """Appends one row per logged step to ``metrics.csv``; on resume keeps the rows up to the resumed step."""

    def __init__(self, out_dir: str, resume_step: int, tensorboard: bool) -> None:
        self.path = os.path.join(out_dir, "metrics.csv")
        rows = []
        if resume_step > 0 and os.path.isfile(self.path):
            with open(self.path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        self.file = open(self.path, "w", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=COLUMNS)
        self.writer.writeheader()
        self.writer.writerows(rows)
        self.file.flush()
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ValueError("output.tensorboard: needs the tensorboard package (pip install tensorboard)") from exc
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step + 1)

    def write(self, row: dict[str, float | None]) -> None:
        self.writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in COLUMNS})
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and v is not None:
                    self.tb.add_scalar(k, v, int(row["step"]))

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def write_expert_load(out_dir: str, load_totals: torch.Tensor, first_moe_block: int) -> None:
    """``expert_load.csv``: tokens routed to each expert of each MoE block over the whole run (all ranks)."""
    with open(os.path.join(out_dir, "expert_load.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(("block", "expert", "tokens"))
        for i, row in enumerate(load_totals.tolist()):
            writer.writerows((first_moe_block + i, e, n) for e, n in enumerate(row))


def write_plots(out_dir: str) -> str | None:
    """From ``metrics.csv`` and ``expert_load.csv`` in ``out_dir``: ``loss.png`` (train/eval loss and tokens/s over
    steps) and ``expert_load.png`` (each MoE block's routed tokens per expert over the run, relative to a uniform
    share). Returns None when written, else the reason they were not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'moe_ep_plugin[plots]')"
    with open(os.path.join(out_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 1))
    ax_loss.plot(steps, [float(r["loss"]) for r in rows], label="train loss (LM + aux)")
    evals = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    if evals:
        ax_loss.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax_loss.set_ylabel("cross-entropy (nats/token)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_speed.plot(steps, [float(r["tokens_per_s"]) for r in rows], color="tab:green")
    ax_speed.set_ylabel("tokens/s (all ranks)")
    ax_speed.set_xlabel("step")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=110)
    plt.close(fig)

    with open(os.path.join(out_dir, "expert_load.csv"), newline="") as f:
        cells = [(int(r["block"]), int(r["expert"]), int(r["tokens"])) for r in csv.DictReader(f)]
    if not cells:  # no MoE blocks
        return None
    blocks = sorted({b for b, _, _ in cells})
    loads = torch.zeros(len(blocks), max(e for _, e, _ in cells) + 1, dtype=torch.float64)
    for b, e, n in cells:
        loads[blocks.index(b), e] = n
    relative = (loads / loads.mean(dim=1, keepdim=True).clamp_min(1e-9)).numpy()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * loads.shape[1] + 2), 1.0 + 0.6 * loads.shape[0]))
    image = ax.imshow(relative, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=2.0, interpolation="nearest")
    ax.set_xlabel("routed expert")
    ax.set_ylabel("block")
    ax.set_yticks(range(len(blocks)), [str(b) for b in blocks])
    ax.set_title("tokens per expert over the run / uniform share")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "expert_load.png"), dpi=110)
    plt.close(fig)
    return None
