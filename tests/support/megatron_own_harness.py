"""Megatron-LM's own MoE unit tests (``tests/unit_tests/transformer/moe/``) on CPU gloo ranks against this library:
copied over ``tests/unit_tests/conftest.py`` of a Megatron-LM copy (docs/compat.md "Megatron-LM main's own MoE
tests" gives the commands). Not a test of this suite, and never imported by it: it patches torch for the whole
process.

Megatron's tests build on CUDA and skip without it; here ``.cuda()`` leaves tensors and modules on the host, the
process group is gloo, Megatron's CUDA RNG tracker is its no-op one (``moe_ep_plugin.megatron.host``), the tensor-
parallel collectives and CUDA streams are the host stand-ins of ``tests/support/megatron_host.py``, and
``moe_ep_plugin.megatron.install()`` serves the ``flex`` backends (Megatron's availability flags set, since this
library serves them without DeepEP, HybridEP or TransformerEngine's NCCL EP). ``torch.cuda.is_available()`` answers
True only while pytest collects, so that the tests' ``skipif(not CUDA)`` marks let them run.
"""

import typing

import typing_extensions

typing.override = typing_extensions.override  # Megatron-LM main's training package uses Python 3.12's

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_available = torch.cuda.is_available
torch.cuda.is_available = lambda: True
torch.cuda.set_device = lambda *args, **kwargs: None
torch.cuda.device_count = lambda: 1
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.memory.empty_cache = lambda: None
torch.cuda.current_device = lambda: torch.device("cpu")
torch.cuda.get_device_name = lambda *args, **kwargs: "cpu"
torch.cuda.get_device_capability = lambda *args, **kwargs: (0, 0)  # no Hopper-only path taken
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.nn.Module.cuda = lambda self, *args, **kwargs: self
_init_process_group = dist.init_process_group


def _gloo_process_group(*args, backend=None, **kwargs):
    """Megatron's ``Utils.initialize_distributed`` asks for NCCL; its ranks here are CPU processes."""
    return _init_process_group(*args, backend="gloo", **kwargs)


dist.init_process_group = _gloo_process_group

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.transformer.moe import fused_a2a  # noqa: E402

import moe_ep_plugin.megatron as ep_megatron  # noqa: E402
from moe_ep_plugin.megatron.host import seed_model_parallel_rng  # noqa: E402
from support.megatron_host import cuda_streams_are_host, tp_collectives_through_host  # noqa: E402

ep_megatron.install(ep_megatron.PluginOptions(transport="torch"))
fused_a2a.HAVE_DEEP_EP = fused_a2a.HAVE_HYBRIDEP = True
if hasattr(fused_a2a, "HAVE_TE_EP"):  # ncclep (megatron-core >= 0.19)
    fused_a2a.HAVE_TE_EP = True
tensor_parallel.model_parallel_cuda_manual_seed = lambda seed, *args, **kwargs: seed_model_parallel_rng(seed)
tensor_parallel.random.model_parallel_cuda_manual_seed = tensor_parallel.model_parallel_cuda_manual_seed
tp_collectives_through_host().__enter__()  # for the whole process: every test's layers run on gloo
cuda_streams_are_host().__enter__()


def pytest_collection_finish(session) -> None:
    """After collection, CUDA is absent again (Megatron's and this library's code then take their host paths)."""
    torch.cuda.is_available = _available
