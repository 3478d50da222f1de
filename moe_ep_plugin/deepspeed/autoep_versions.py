"""The transformers releases DeepSpeed AutoEP runs with: one table, read by ``setup.py``'s ``autoep`` extra and by
:func:`check_autoep_versions` (the DeepSpeed example's ``dispatcher: autoep``; call it before
``moe_ep_plugin.install_deep_ep()`` and ``deepspeed.initialize`` in code of your own). Only the standard library
at import: ``setup.py`` loads this file by path, before torch or DeepSpeed is installed.
"""

from __future__ import annotations

from importlib import metadata

# DeepSpeed version → (the transformers versions its AutoEP runs with, what happens outside them). 0.19.8: 5.22.2
# is tested (CI). From 5.23.0 transformers' output-capture registry is a dict subclass whose get() takes one
# argument, and AutoEP (its auto_ep_presets/base.py) calls get(key, default): "_CanRecordRegistry.get() takes 2
# positional arguments but 3 were given" inside deepspeed.initialize (read in the 5.23.0, 5.24.0 and 5.25.0 wheels).
# Older transformers releases are not tested, so the range starts at 5.22.2.
AUTOEP_TRANSFORMERS = {
    "0.19.8": (">=5.22.2,<5.23", "from 5.23.0 it fails inside deepspeed.initialize; older releases are not tested")
}
DEEPSPEED_TESTED = "0.19.8"


def autoep_requirements() -> list[str]:
    """The ``autoep`` extra's requirements: the tested DeepSpeed and the transformers range it runs with."""
    return [f"deepspeed=={DEEPSPEED_TESTED}", f"transformers{AUTOEP_TRANSFORMERS[DEEPSPEED_TESTED][0]}"]


def autoep_version_error(deepspeed_version: str, transformers_version: str) -> str | None:
    """Why DeepSpeed ``deepspeed_version``'s AutoEP cannot run with transformers ``transformers_version`` (one
    line), or None: the pair is in the table's range, or that DeepSpeed has no entry (not tested, so not refused)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    entry = AUTOEP_TRANSFORMERS.get(Version(deepspeed_version).base_version)
    if entry is None or Version(transformers_version) in SpecifierSet(entry[0]):
        return None
    wanted, outside = entry
    return (
        f"DeepSpeed {deepspeed_version}'s AutoEP runs with transformers{wanted} ({outside}), but transformers "
        f"{transformers_version} is installed: pip install 'transformers{wanted}'"
    )


def check_autoep_versions() -> None:
    """Raise ``RuntimeError`` (one line naming both installed versions and the range) when the installed DeepSpeed's
    AutoEP cannot run with the installed transformers; a package that is not installed is not checked here."""
    try:
        versions = metadata.version("deepspeed"), metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return
    why = autoep_version_error(*versions)
    if why is not None:
        raise RuntimeError(why)
