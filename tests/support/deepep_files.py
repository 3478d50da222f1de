"""Running one of DeepEP's own test files against this library (tests/gpu/test_deepep_own_tests.py on a GPU,
tests/test_deepep_own_tests_cpu.py on the CPU): the file from the DeepEP checkout ``source``, with
``tests/support/deepep_own`` first on ``PYTHONPATH`` (there ``import deep_ep`` is this library)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.join(ROOT, "tests", "support")


def run_deepep_file(
    source: str, script: str, extra: list[str], ranks: int, rendezvous: str, timeout_s: float, **env: str
) -> None:
    """Run ``tests/<script>`` of ``source`` with ``--num-processes ranks`` and ``extra``; fails the calling test,
    with the end of its output, unless every rank exits 0 within ``timeout_s``. ``env``: more variables for it."""
    path = os.path.join(source, "tests", script)
    environ = dict(
        os.environ,
        **env,
        MOE_EP_DEEPEP_RENDEZVOUS=rendezvous,
        PYTHONPATH=os.pathsep.join([os.path.join(SUPPORT, "deepep_own"), ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    what = f"{script} {extra} at {ranks} ranks"
    # its own process group: a run past the limit is ended with every rank it spawned
    proc = subprocess.Popen(
        [sys.executable, path, "--num-processes", str(ranks), *extra],
        cwd=os.path.dirname(path),
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what}: not done within {timeout_s} s\n{out[-6000:]}")
    print(out[-3000:])
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{out[-6000:]}"
