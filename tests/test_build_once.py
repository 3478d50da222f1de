"""The kernel library is built once: a second build with unchanged csrc/ and flags skips nvcc; a changed source,
a changed flag or --force rebuilds (a stand-in nvcc counts its runs; no CUDA needed)."""

from __future__ import annotations

import os
import stat

from moe_ep_plugin import _build


def _fake_tree(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "a.cu").write_text("// kernel a\n")
    (csrc / "moe_ep.h").write_text("// header\n")
    log = tmp_path / "nvcc_runs"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho run >> "{log}"\nfor a; do out="$a"; done\necho lib > "$out"\n')
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(_build, "_ROOT", str(tmp_path))
    monkeypatch.setattr(_build, "find_nvcc", lambda: str(nvcc))
    monkeypatch.delenv("MOE_EP_NVCC_FLAGS", raising=False)
    return csrc, lambda: len(log.read_text().splitlines()) if log.exists() else 0


def test_build_once_and_rebuild_on_change(tmp_path, monkeypatch) -> None:
    csrc, runs = _fake_tree(tmp_path, monkeypatch)
    out = str(tmp_path / "lib" / "libx.so")
    assert _build.build_kernels(output=out) == out and runs() == 1
    assert _build.build_kernels(output=out) == out and runs() == 1  # unchanged: no nvcc
    (csrc / "moe_ep.h").write_text("// header, edited\n")  # a header counts too
    _build.build_kernels(output=out)
    assert runs() == 2
    monkeypatch.setenv("MOE_EP_NVCC_FLAGS", "-DMOE_EP_CHUNK_ROWS=16")  # other flags: another library
    _build.build_kernels(output=out)
    assert runs() == 3
    _build.build_kernels(output=out, force=True)
    assert runs() == 4
    os.remove(out)  # the stamp alone is not enough
    _build.build_kernels(output=out)
    assert runs() == 5 and os.path.isfile(out)
