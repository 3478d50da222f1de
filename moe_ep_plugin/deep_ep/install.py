"""The opt-in that makes ``import deep_ep`` resolve to :mod:`moe_ep_plugin.deep_ep`.

Two ways in, both refusing to shadow a real, importable DeepEP unless told to:

- in Python, before the framework imports DeepEP: ``moe_ep_plugin.install_deep_ep()``;
- in a launch script, with no code change: put the directory ``python -m moe_ep_plugin.deep_ep`` prints first on
  ``PYTHONPATH``. It holds a one-file ``deep_ep`` package that calls :func:`install_deep_ep` when imported
  (``MOE_EP_DEEP_EP_FORCE=1`` passes ``force=True``).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from types import ModuleType

SHADOW_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shadow")
_SHADOW_INIT = os.path.join(SHADOW_DIR, "deep_ep", "__init__.py")
_NAMES = ("deep_ep", "deep_ep.utils")


def _ours() -> ModuleType:
    from moe_ep_plugin import deep_ep

    return deep_ep


def real_deep_ep_origin() -> str | None:
    """Where a ``deep_ep`` other than this library's would be imported from (a loaded module's file, or the first
    one on ``sys.path``), or None."""
    loaded = sys.modules.get("deep_ep")
    if loaded is not None and loaded is not _ours() and not getattr(loaded, "__moe_ep_shadow__", False):
        return getattr(loaded, "__file__", None) or repr(loaded)
    for entry in sys.path:
        spec = importlib.machinery.PathFinder.find_spec("deep_ep", [entry or os.getcwd()])
        if spec is not None and os.path.abspath(spec.origin or entry) != _SHADOW_INIT:
            return spec.origin or entry
    return None


def install_deep_ep(force: bool = False) -> ModuleType:
    """Register :mod:`moe_ep_plugin.deep_ep` as ``deep_ep`` (and its ``utils`` as ``deep_ep.utils``) in
    ``sys.modules``; idempotent.

    Arguments:
        force: shadow a real DeepEP that is importable (or already imported); without it that is a RuntimeError
            naming where the real one lives.

    Returns:
        The module now imported as ``deep_ep``.

    With DeepSpeed imported, whose only ``deep_ep`` user is AutoEP (``expert_parallel.comm_backend: deepep``), an
    installed transformers its AutoEP fails with is a RuntimeError naming both versions and the range
    (``moe_ep_plugin/deepspeed/autoep_versions.py``), before ``deep_ep`` is registered; other users are not checked.
    """
    if not isinstance(force, bool):
        raise TypeError(f"force: expected a bool, got {force!r}")
    if "deepspeed" in sys.modules:
        # AutoEP fails inside deepspeed.initialize with such a transformers, in DeepSpeed's traceback: refuse here.
        from ..deepspeed.autoep_versions import check_autoep_versions

        try:
            check_autoep_versions()
        except RuntimeError as exc:
            raise RuntimeError(f"install_deep_ep: {exc}") from None
    ours = _ours()
    if sys.modules.get("deep_ep") is ours:
        return ours
    origin = real_deep_ep_origin()
    if origin is not None and not force:
        raise RuntimeError(
            f"install_deep_ep: a real deep_ep is importable ({origin}); moe_ep_plugin does not shadow "
            f"it silently. Uninstall it, or pass force=True (MOE_EP_DEEP_EP_FORCE=1 for the PYTHONPATH "
            f"switch) to use moe_ep_plugin.deep_ep instead"
        )
    for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
        del sys.modules[name]  # a forced install drops the real package's modules too
    sys.modules["deep_ep"] = ours
    sys.modules["deep_ep.utils"] = ours.utils
    return ours


def uninstall_deep_ep() -> None:
    """Undo :func:`install_deep_ep` (a later ``import deep_ep`` finds whatever ``sys.path`` holds)."""
    ours = _ours()
    for name in _NAMES:
        if sys.modules.get(name) in (ours, ours.utils):
            del sys.modules[name]
