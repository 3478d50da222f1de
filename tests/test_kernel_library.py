"""The built kernel library loads on this (CPU) machine with every C function the Python side declares.

CI builds ``csrc/`` before the tests, so a symbol dropped or renamed in C (or an ABI version bump not mirrored in
``_ext.py``) fails here, not first on the GPU machine. Skips when the library has not been built.
"""
from __future__ import annotations

import os

import pytest

from moe_ep_plugin import _ext, permute


@pytest.mark.skipif(not os.path.isfile(_ext.library_path()),
                    reason="kernel library not built (python -m moe_ep_plugin._build)")
def test_every_declared_function_is_exported() -> None:
    lib = _ext.load()  # raises on a missing symbol or an ABI mismatch
    assert lib.moe_ep_abi_version() == _ext.ABI_VERSION
    assert permute._kernels() is not None, "csrc/permute.cu functions missing from the library"
