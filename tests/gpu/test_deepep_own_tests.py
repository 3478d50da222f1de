"""DeepEP's own test files, unchanged, against this library through its ``deep_ep`` module, with their ranks
sharing one GPU: ``tests/legacy/test_intranode.py`` and ``tests/legacy/test_low_latency.py`` (V1 ``Buffer``,
normal and low-latency) and ``tests/elastic/test_ep.py`` (V2 ``ElasticBuffer``; correctness only, with and without
its CPU sync). Each file checks its own results against its own references and asserts; a run passes when every
rank exits 0.

They come from a DeepEP checkout named by ``MOE_EP_DEEPEP_SRC`` (its ``tests/`` and ``deep_ep/utils/``; nothing of
DeepEP is kept here). ``tests/support/deepep_own`` goes first on ``PYTHONPATH``: there ``import deep_ep`` is this
library and ``deep_ep.utils.envs`` starts the ranks over gloo on ``cuda:0`` (``tests/support/deepep_envs.py``),
since DeepEP's own start-up is NCCL with one process per GPU through its compiled ``_C``. More than two ranks need
an MPS daemon for their kernels to run side by side (docs/gpu_testing.md). Skips without a GPU, the kernel library
or ``MOE_EP_DEEPEP_SRC``, naming which.
"""

from __future__ import annotations

import os

import pytest
from support.deepep_files import run_deepep_file
from support.gpu_marks import NEEDS_KERNELS

SOURCE = os.environ.get("MOE_EP_DEEPEP_SRC", "")
TIMEOUT_S = 540

# (DeepEP test file, its arguments beyond --num-processes)
CASES = [
    pytest.param("legacy/test_intranode.py", [], id="intranode"),
    pytest.param("legacy/test_low_latency.py", [], id="low_latency"),
    pytest.param("elastic/test_ep.py", ["--skip-perf-test", "--do-cpu-sync", "1"], id="elastic-cpu_sync"),
    pytest.param("elastic/test_ep.py", ["--skip-perf-test", "--do-cpu-sync", "0"], id="elastic-no_cpu_sync"),
]

pytestmark = [
    *NEEDS_KERNELS,
    pytest.mark.skipif(
        not os.path.isfile(os.path.join(SOURCE, "tests", "legacy", "test_intranode.py")),
        reason="set MOE_EP_DEEPEP_SRC to a DeepEP checkout (its tests/ and deep_ep/utils/)",
    ),
]


@pytest.mark.parametrize("ranks", [2, 4], ids=lambda r: f"{r}ranks")
@pytest.mark.parametrize("script,extra", CASES)
def test_deepep_test_file_passes(script: str, extra: list[str], ranks: int, tmp_path) -> None:
    run_deepep_file(SOURCE, script, extra, ranks, str(tmp_path / "rendezvous"), TIMEOUT_S)
