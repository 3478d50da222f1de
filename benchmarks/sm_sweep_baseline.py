"""benchmarks/sm_sweep.py over the kernels and Python of commit abe3312 (the code whose EP 2 kernel times across two
H200s are known), ranks sharing one GPU: what ``benchmarks/ep_model.py --check`` fits.

    git worktree add /tmp/abe3312 abe3312 && (cd /tmp/abe3312 && python3 -m moe_ep_plugin._build --required)
    OLD_TREE=/tmp/abe3312 python3 benchmarks/sm_sweep_baseline.py --ranks 2 --sms 8,24 --tokens 4096,1024 --record

That code's Buffer takes CUDA only over an NCCL group (one rank per GPU), so while it is built its backend query
answers "nccl" for the gloo group the ranks share; its transport needs only gloo's object collectives. The copy
yardstick (this tree's peer-region call) is left out; rows are recorded as ``sm_sweep, abe3312 kernels``.
"""

import importlib
import os
import sys
import types

import torch.distributed as dist

sys.path.insert(0, os.environ["OLD_TREE"])
import moe_ep_plugin  # noqa: E402
import moe_ep_plugin.buffer as old_buffer  # noqa: E402

# that code's fp8 module sat at the package's top level
_fp8 = importlib.import_module("moe_ep_plugin.fp8")
_ops = types.ModuleType("moe_ep_plugin.ops")
_ops.fp8 = _fp8
sys.modules["moe_ep_plugin.ops"] = _ops
sys.modules["moe_ep_plugin.ops.fp8"] = _fp8


class SharedBuffer(old_buffer.Buffer):
    """abe3312's Buffer on a CUDA device shared by the ranks of a gloo group (``device`` as today's takes it)."""

    def __init__(self, group, transport="auto", device=None, **kw):
        real = dist.get_backend
        if device is not None and str(device) != "cpu":
            old_buffer.dist.get_backend = lambda g=None: "nccl"
        try:
            super().__init__(group, transport=transport, **kw)
        finally:
            old_buffer.dist.get_backend = real


moe_ep_plugin.Buffer = SharedBuffer
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sm_sweep  # noqa: E402

sm_sweep.Buffer = SharedBuffer
sm_sweep._time_copy = lambda *args, **kwargs: float("nan")
_record = sm_sweep.records.record


def _baseline_record(args, benchmark, configuration, plugin, stock, unit, kind="measured", device=None):
    if not configuration["kernel"].startswith("copy"):
        _record(args, "sm_sweep, abe3312 kernels", configuration, plugin, None, unit, kind, device)


sm_sweep.records.record = _baseline_record
sm_sweep.records._commit = lambda: "abe3312"  # the kernels' commit, not this tree's

if __name__ == "__main__":
    sm_sweep.main()
