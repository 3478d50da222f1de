"""DeepSpeed AutoEP and transformers: the one table of the versions that work (``moe_ep_plugin/deepspeed/
autoep_versions.py``) is what ``setup.py``'s ``autoep`` extra pins, and the DeepSpeed example refuses a pair outside
it with one line naming both versions and the range (exit code 2, no rank started) instead of DeepSpeed's traceback."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

from moe_ep_plugin.deepspeed import autoep_versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANGE = ">=5.22.2,<5.23"
REFUSAL = (
    "DeepSpeed 0.19.8's AutoEP runs with transformers>=5.22.2,<5.23 (from 5.23.0 it fails inside "
    "deepspeed.initialize; older releases are not tested), but transformers {} is installed: "
    "pip install 'transformers>=5.22.2,<5.23'"
)


@pytest.mark.parametrize(
    "transformers, refused",
    [("5.22.2", False), ("5.22.3", False), ("5.23.0", True), ("5.25.0", True), ("5.22.1", True), ("4.57.6", True)],
)
def test_the_range_of_deepspeed_0_19_8(transformers: str, refused: bool) -> None:
    expected = REFUSAL.format(transformers) if refused else None
    assert autoep_versions.autoep_version_error("0.19.8", transformers) == expected


def test_a_deepspeed_without_an_entry_is_not_refused() -> None:
    assert autoep_versions.autoep_version_error("0.20.0", "5.25.0") is None


def test_setup_extra_pins_the_table() -> None:
    assert autoep_versions.autoep_requirements() == ["deepspeed==0.19.8", f"transformers{RANGE}"]
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        assert (
            '"autoep": _load("_moe_ep_autoep_versions", "deepspeed", "autoep_versions.py").autoep_requirements()'
            in f.read()
        )


def _installed(monkeypatch: pytest.MonkeyPatch, transformers: str) -> None:
    """Make the check see DeepSpeed 0.19.8 and transformers ``transformers`` installed."""
    found = {"deepspeed": "0.19.8", "transformers": transformers}
    fake = types.SimpleNamespace(
        version=found.__getitem__, PackageNotFoundError=autoep_versions.metadata.PackageNotFoundError
    )
    monkeypatch.setattr(autoep_versions, "metadata", fake)


def test_check_raises_one_line_naming_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, "5.25.0")
    with pytest.raises(RuntimeError) as info:
        autoep_versions.check_autoep_versions()
    assert str(info.value) == REFUSAL.format("5.25.0")
    _installed(monkeypatch, "5.22.2")
    autoep_versions.check_autoep_versions()


def test_the_example_refuses_before_any_rank(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    spec = importlib.util.spec_from_file_location(
        "deepspeed_moe_example", os.path.join(ROOT, "examples", "deepspeed_moe.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(example.launch, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    _installed(monkeypatch, "5.25.0")
    assert example.cli(["--config", os.path.join(ROOT, "configs", "deepspeed_autoep.yaml")]) == 2
    assert capsys.readouterr().err == (
        f"deepspeed_moe.py: config error: dispatcher: 'autoep': {REFUSAL.format('5.25.0')}\n"
    )
