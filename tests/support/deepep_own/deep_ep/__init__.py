"""The ``deep_ep`` that DeepEP's own test files import when tests/gpu/test_deepep_own_tests.py (or, on the CPU,
tests/test_deepep_own_tests_cpu.py) runs them against this library (this directory goes first on ``PYTHONPATH``,
so their spawned ranks import it too):

- ``deep_ep`` itself, with ``deep_ep.utils``: ``moe_ep_plugin.deep_ep``, installed as the opt-in does;
- ``deep_ep.utils.envs``: ``tests/support/deepep_envs.py``, the start-up of ranks sharing one GPU over gloo, in
  place of DeepEP's, which starts NCCL with one process per GPU through DeepEP's compiled ``_C``; with
  ``MOE_EP_DEEPEP_CPU=1``, ``tests/support/deepep_cpu.py`` instead, its ranks on the CPU, with its CUDA stand-ins
  installed before anything of DeepEP loads and its timers in place of ``deep_ep.utils.testing``'s;
- ``deep_ep.utils.math``, ``.testing``, ``.gate``, ``.refs``: DeepEP's own pure-torch test utilities, loaded from
  the DeepEP checkout named by ``MOE_EP_DEEPEP_SRC`` (nothing of DeepEP is kept in this repository).
"""

import importlib.util
import os
import sys

from moe_ep_plugin.deep_ep.install import install_deep_ep

_SUPPORT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEEPEP_UTILS = ("math", "testing", "gate", "refs")  # in this order: refs imports .envs and .math
_ON_CPU = os.environ.get("MOE_EP_DEEPEP_CPU") == "1"


def _load(name: str, path: str) -> None:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its relative imports find the modules registered so far
    spec.loader.exec_module(module)


install_deep_ep(force=True)  # this directory is a stand-in, not a real DeepEP to keep
if _ON_CPU:
    # tests/, for ``support``; last, as it has a test_low_latency.py too and test_intranode.py imports DeepEP's
    sys.path.append(os.path.dirname(_SUPPORT))
    from support import deepep_cpu

    deepep_cpu.install()
    sys.modules["deep_ep.utils.envs"] = deepep_cpu
else:
    _load("deep_ep.utils.envs", os.path.join(_SUPPORT, "deepep_envs.py"))
for _name in _DEEPEP_UTILS:
    _load(f"deep_ep.utils.{_name}", os.path.join(os.environ["MOE_EP_DEEPEP_SRC"], "deep_ep", "utils", f"{_name}.py"))
if _ON_CPU:
    deepep_cpu.shrink_testing(sys.modules["deep_ep.utils.testing"])
