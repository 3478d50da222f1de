"""The example MoE trainer as a plain script: what `moe-ep-train` does, spelled out with the library API.

python examples/train_moe.py configs/tiny.yaml                       # spawns parallel.nprocs local ranks
python examples/train_moe.py configs/tiny.yaml --set train.steps=50  # override any key
torchrun --nproc-per-node 2 examples/train_moe.py configs/ep2_h200.yaml
"""

import argparse
import sys

from moe_ep_plugin import launch
from moe_ep_plugin.recipes.common.yaml_sections import config_error
from moe_ep_plugin.recipes.train import config, trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    try:
        # Strict load: an unknown key or an impossible value raises ValueError naming the key; preflight checks
        # what needs this machine or the data (a GPU for nccl/nvlink, a corpus longer than model.seq_len).
        cfg = config.load(args.config, tuple(args.set))
        backend = trainer.preflight(cfg)
    except ValueError as exc:
        return config_error("train_moe.py", exc)  # one line, exit code 2
    # Under torchrun this joins its ranks; otherwise it starts parallel.nprocs processes (gloo on CPU, NCCL on GPU),
    # and each one runs trainer.run(cfg): build the Buffer on the EP group, the model, and train. A failed rank
    # ends the others; the exit code is then 1.
    return launch.run_ranks(
        "train_moe.py", trainer.run, cfg.parallel.nprocs, (cfg,), backend=backend, timeout_s=cfg.parallel.timeout_s
    )


if __name__ == "__main__":
    sys.exit(main())
