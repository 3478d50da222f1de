"""The ``import deep_ep`` opt-in: ``moe_ep_plugin.install_deep_ep()`` and the ``PYTHONPATH`` switch
(``python -m moe_ep_plugin.deep_ep``); both refuse to shadow a real, importable DeepEP unless forced. Each case
runs in a fresh interpreter (the opt-in changes ``sys.modules``)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORTS = (
    "import deep_ep, deep_ep.utils; from deep_ep import Buffer, Config, ElasticBuffer, EPBuffer, EPHandle, "
    "EventOverlap, topk_idx_t; from deep_ep.utils import EventOverlap, EventHandle; "
    "import moe_ep_plugin.deep_ep as ours; assert deep_ep is ours and deep_ep.utils is ours.utils; "
    "assert topk_idx_t is __import__('torch').int64 and Buffer.is_sm90_compiled(); print('served')"
)


def _run(code: str, pythonpath: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MOE_EP_DEEP_EP_FORCE"}
    environ.update(PYTHONPATH=os.pathsep.join(pythonpath + [ROOT]), **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def real_deep_ep(tmp_path) -> str:
    """A directory holding a stand-in for a real ``deep_ep`` package."""
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path)


def _shadow() -> str:
    out = subprocess.run(
        [sys.executable, "-m", "moe_ep_plugin.deep_ep"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_install_serves_every_name() -> None:
    out = _run("import moe_ep_plugin; moe_ep_plugin.install_deep_ep(); moe_ep_plugin.install_deep_ep(); " + IMPORTS, [])
    assert out.returncode == 0 and "served" in out.stdout, out.stderr


def test_install_refuses_a_real_deep_ep(real_deep_ep: str) -> None:
    out = _run("import moe_ep_plugin; moe_ep_plugin.install_deep_ep()", [real_deep_ep])
    assert out.returncode != 0 and "a real deep_ep is importable" in out.stderr and real_deep_ep in out.stderr
    out = _run(
        "import deep_ep; assert deep_ep.REAL; import moe_ep_plugin; moe_ep_plugin.install_deep_ep()", [real_deep_ep]
    )
    assert out.returncode != 0 and "a real deep_ep is importable" in out.stderr
    out = _run(
        "import deep_ep; import moe_ep_plugin; moe_ep_plugin.install_deep_ep(force=True); " + IMPORTS, [real_deep_ep]
    )
    assert out.returncode == 0 and "served" in out.stdout, out.stderr
    out = _run("import moe_ep_plugin; moe_ep_plugin.install_deep_ep(force=1)", [])
    assert out.returncode != 0 and "force: expected a bool" in out.stderr


def test_pythonpath_switch(real_deep_ep: str) -> None:
    shadow = _shadow()
    assert os.path.isfile(os.path.join(shadow, "deep_ep", "__init__.py"))
    out = _run(IMPORTS, [shadow])
    assert out.returncode == 0 and "served" in out.stdout, out.stderr
    out = _run("import deep_ep", [shadow, real_deep_ep])
    assert out.returncode != 0 and "a real deep_ep is importable" in out.stderr and "MOE_EP_DEEP_EP_FORCE" in out.stderr
    out = _run(IMPORTS, [shadow, real_deep_ep], env={"MOE_EP_DEEP_EP_FORCE": "1"})
    assert out.returncode == 0 and "served" in out.stdout, out.stderr


def test_uninstall_restores_the_search() -> None:
    code = (
        "import sys, moe_ep_plugin; from moe_ep_plugin.deep_ep.install import uninstall_deep_ep; "
        "moe_ep_plugin.install_deep_ep(); uninstall_deep_ep(); assert 'deep_ep' not in sys.modules; "
        "import importlib.util; assert importlib.util.find_spec('deep_ep') is None; print('restored')"
    )
    out = _run(code, [])
    assert out.returncode == 0 and "restored" in out.stdout, out.stderr


# importlib.metadata made to report transformers 5.25.0 (outside DeepSpeed 0.19.8's AutoEP range), the rest as installed
_TRANSFORMERS_5_25 = (
    "import importlib.metadata as m; real = m.version; "
    "m.version = lambda name: '5.25.0' if name == 'transformers' else real(name); "
)


def test_install_refuses_a_transformers_autoep_fails_with_once_deepspeed_is_imported() -> None:
    """DeepSpeed's only ``deep_ep`` user is AutoEP: with DeepSpeed imported, the opt-in refuses a transformers outside
    the range in one line naming both versions; without DeepSpeed (another framework's ``deep_ep`` user) it serves."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    from moe_ep_plugin.deepspeed.autoep_versions import AUTOEP_TRANSFORMERS

    version = importlib.metadata.version("deepspeed")
    if version not in AUTOEP_TRANSFORMERS:
        pytest.skip(f"DeepSpeed {version} has no AutoEP range in the table")
    code = (
        "import deepspeed; "
        + _TRANSFORMERS_5_25
        + "import sys, moe_ep_plugin\n"
        + "try:\n    moe_ep_plugin.install_deep_ep()\nexcept RuntimeError as exc:\n"
        + "    print(exc); assert 'deep_ep' not in sys.modules\nelse:\n    raise SystemExit('served')"
    )
    out = _run(code, [], env={"DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (
        f"install_deep_ep: DeepSpeed {version}'s AutoEP runs with transformers>=5.22.2,<5.23 (from 5.23.0 it fails "
        "inside deepspeed.initialize; older releases are not tested), but transformers 5.25.0 is installed: "
        "pip install 'transformers>=5.22.2,<5.23'"
    )
    out = _run(_TRANSFORMERS_5_25 + "import moe_ep_plugin; moe_ep_plugin.install_deep_ep(); " + IMPORTS, [])
    assert out.returncode == 0 and "served" in out.stdout, out.stderr
