"""DeepEP's own test files, unchanged, against this library on the CPU at 2 ranks: what
tests/gpu/test_deepep_own_tests.py runs on a GPU (``tests/legacy/test_intranode.py`` and
``tests/legacy/test_low_latency.py`` for the V1 ``Buffer``, ``tests/elastic/test_ep.py`` with and without its CPU
sync for the V2 ``ElasticBuffer``), here at small sizes so that the library's host side answers DeepEP's own
checks wherever a machine has no GPU. Each file checks its results against its own references and asserts; a run
passes when every rank exits 0.

They come from a DeepEP checkout named by ``MOE_EP_DEEPEP_SRC``; ``tests/support/deepep_own`` goes first on
``PYTHONPATH`` and, with ``MOE_EP_DEEPEP_CPU=1``, starts the ranks on the CPU over gloo with the CUDA stand-ins of
``tests/support/deepep_cpu.py`` (the files' timing parts run shrunk or answered without a run: only their
correctness parts are a check here). Measured on a 2-core machine (the high ends while it was busy with other work):
intranode 12-22 s, low_latency 11-37 s, each elastic case 20-43 s; 67-112 s in all. Skips, saying why, unless
``MOE_EP_DEEPEP_SRC`` names a checkout with the files used.
"""

from __future__ import annotations

import os

import pytest
from support.deepep_files import run_deepep_file

SOURCE = os.environ.get("MOE_EP_DEEPEP_SRC", "")
SCRIPTS = ("legacy/test_intranode.py", "legacy/test_low_latency.py", "elastic/test_ep.py")
UTILS = ("math", "testing", "gate", "refs")  # what tests/support/deepep_own/deep_ep loads from it
TIMEOUT_S = 300
RANKS = 2

# (DeepEP test file, its arguments beyond --num-processes): sizes that keep each well under two minutes on two
# cores yet give every rank tokens for every other (low_latency's hidden a multiple of 512 for its UE8M0 scales)
ELASTIC = ["--skip-perf-test", "--num-tokens", "128", "--hidden", "512", "--num-topk", "6", "--num-experts", "64"]
CASES = [
    pytest.param(
        "legacy/test_intranode.py",
        ["--num-tokens", "128", "--hidden", "512", "--num-topk", "8", "--num-experts", "32"],
        id="intranode",
    ),
    pytest.param(
        "legacy/test_low_latency.py",
        ["--num-tokens", "64", "--hidden", "1024", "--num-topk", "8", "--num-experts", "32"],
        id="low_latency",
    ),
    pytest.param("elastic/test_ep.py", [*ELASTIC, "--do-cpu-sync", "1"], id="elastic-cpu_sync"),
    pytest.param("elastic/test_ep.py", [*ELASTIC, "--do-cpu-sync", "0"], id="elastic-no_cpu_sync"),
]


def _skip_reason() -> str:
    """Why the cases cannot run here, or ``""`` when ``MOE_EP_DEEPEP_SRC`` names a checkout with every file used."""
    if not SOURCE:
        return "set MOE_EP_DEEPEP_SRC to a DeepEP checkout (its tests/ and deep_ep/utils/)"
    needed = [f"tests/{s}" for s in SCRIPTS] + [f"deep_ep/utils/{u}.py" for u in UTILS]
    missing = [p for p in needed if not os.path.isfile(os.path.join(SOURCE, p))]
    return f"MOE_EP_DEEPEP_SRC={SOURCE} is not a DeepEP checkout: no {missing[0]}" if missing else ""


SKIP_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)


@pytest.mark.parametrize("script,extra", CASES)
def test_deepep_test_file_passes_on_cpu(script: str, extra: list[str], tmp_path) -> None:
    run_deepep_file(SOURCE, script, extra, RANKS, str(tmp_path / "rendezvous"), TIMEOUT_S, MOE_EP_DEEPEP_CPU="1")
