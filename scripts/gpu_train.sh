#!/usr/bin/env bash
# GPU proof of the example trainer (issue 3), for the 2 x H200 device machine: a short EP=2 run of
# configs/ep2_h200.yaml (BF16, FP8 dispatch, NCCL), then a 2-step torchrun launch of the same config.
# Small results go to $OUT (device tool) or runs/gpu_train/: train.log, metrics.csv (loss and tokens/s per step),
# expert_load.csv, summary.txt, and loss.png/expert_load.png when matplotlib is there (else draw them afterwards
# with `moe-ep-train --plot <that folder>`). Checkpoints stay in a scratch folder. Takes about 2 minutes.
# Extra arguments are passed to the trainer, e.g. `--set parallel.transport=torch` to use the reference transport.
# Needs PyYAML and tqdm: installed from .whl/ (carry it) when the machine lacks them.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh" gpu_train
RUN="$(mktemp -d)/ep2_h200"
python3 -c "import yaml, tqdm" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pyyaml tqdm || exit 1
status=0
timeout 170 python3 -m moe_ep_plugin.train.cli configs/ep2_h200.yaml --set output.dir="$RUN" \
    --set output.progress_bar=false "$@" || status=1
cp "$RUN"/train.log "$RUN"/metrics.csv "$RUN"/expert_load.csv "$LOGS"/ 2>/dev/null
cp "$RUN"/*.png "$LOGS"/ 2>/dev/null
python3 - "$LOGS/metrics.csv" <<'PY' | tee "$LOGS/summary.txt"
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
steady = [float(r["tokens_per_s"]) for r in rows[len(rows) // 5:]]  # skip warm-up steps
evals = [(r["step"], r["eval_loss"]) for r in rows if r["eval_loss"]]
print(f"steps {len(rows)}; loss first {float(rows[0]['loss']):.4f} last {float(rows[-1]['loss']):.4f}; "
      f"median tokens/s (all ranks, steps {len(rows) // 5 + 1}+) {statistics.median(steady):,.0f}; "
      f"median step {statistics.median(float(r['step_time_s']) for r in rows[len(rows) // 5:]) * 1e3:.1f} ms; "
      f"eval {evals}")
PY
# The same trainer under torchrun (it joins torchrun's ranks instead of spawning its own).
timeout 90 torchrun --standalone --nproc-per-node 2 -m moe_ep_plugin.train.cli configs/ep2_h200.yaml \
    --set output.dir="$RUN-torchrun" --set output.plots=false --set output.progress_bar=false "$@" --set train.steps=2 \
    2>&1 | tail -n 4 | tee -a "$LOGS/summary.txt" || status=1
rm -rf "$(dirname "$RUN")"
exit $status
