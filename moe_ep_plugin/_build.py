"""Compile csrc/*.cu into moe_ep_plugin/lib/libmoe_ep_kernels.so with nvcc (stdlib only).

Run as ``python -m moe_ep_plugin._build`` (CI does, so a kernel that does not compile never lands) or
implicitly from ``setup.py``, which loads this file and ``ops/library.py`` (the library path) by path. The
library has a plain C ABI and no torch headers, so one build serves every torch version and needs no GPU to
compile.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvcc() -> str | None:
    """Path of nvcc from $CUDA_HOME, PATH or /usr/local/cuda, or None."""
    for candidate in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc") or "",
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_command(nvcc: str, sources: list[str], output: str) -> list[str]:
    """``MOE_EP_CUDA_ARCH`` picks the target (default 90a); ``MOE_EP_NVCC_FLAGS`` adds flags, e.g. a kernel
    tuning macro such as ``-DMOE_EP_CHUNK_ROWS=16`` for a variant library timed against the default."""
    arch = os.environ.get("MOE_EP_CUDA_ARCH", "90a")
    extra = os.environ.get("MOE_EP_NVCC_FLAGS", "").split()
    return [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-lineinfo",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", os.path.join(_ROOT, "csrc"), *extra,
            *sources, "-o", output]


def build_kernels(output: str, required: bool = False) -> str | None:
    """Build the kernel library at ``output`` (``ops.library.LIB_PATH`` is where it loads from); returns its path,
    or None when there is nothing to build with.

    ``required=True`` turns a missing nvcc or missing sources into an error (CI uses it).
    """
    sources = sorted(glob.glob(os.path.join(_ROOT, "csrc", "*.cu")))
    nvcc = find_nvcc()
    if not sources or nvcc is None:
        if required:
            raise RuntimeError(f"cannot build kernels: nvcc={nvcc!r}, sources={len(sources)} in csrc/")
        return None
    os.makedirs(os.path.dirname(output), exist_ok=True)
    cmd = nvcc_command(nvcc, sources, output)
    print("[moe_ep_plugin] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return output


if __name__ == "__main__":
    from .ops.library import LIB_PATH

    out = sys.argv[sys.argv.index("--output") + 1] if "--output" in sys.argv else LIB_PATH
    path = build_kernels(out, required="--required" in sys.argv)
    print(f"[moe_ep_plugin] kernel library: {path}")
