"""Compile csrc/*.cu into moe_ep_plugin/lib/libmoe_ep_kernels.so with nvcc (stdlib only).

Run as ``python -m moe_ep_plugin._build`` (CI does, so a kernel that does not compile never lands) or
implicitly from ``setup.py``, which loads this file and ``ops/library.py`` (the library path) by path. The
library has a plain C ABI and no torch headers, so one build serves every torch version and needs no GPU to
compile. It is built once: a stamp next to it (``<lib>.sha256``) holds the hash of every ``csrc/`` file and of
the nvcc command, and a build whose stamp matches is skipped (``--force`` rebuilds anyway;
``MOE_EP_SKIP_KERNELS=1`` makes ``setup.py`` skip the kernels altogether).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvcc() -> str | None:
    """Path of nvcc from $CUDA_HOME, PATH or /usr/local/cuda, or None."""
    for candidate in (
        os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"),
        shutil.which("nvcc") or "",
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc_command(nvcc: str, sources: list[str], output: str) -> list[str]:
    """``MOE_EP_CUDA_ARCH`` picks the target (default 90a); ``MOE_EP_NVCC_FLAGS`` adds flags, e.g. a kernel
    tuning macro such as ``-DMOE_EP_CHUNK_ROWS=16`` for a variant library timed against the default."""
    arch = os.environ.get("MOE_EP_CUDA_ARCH", "90a")
    extra = os.environ.get("MOE_EP_NVCC_FLAGS", "").split()
    return [
        nvcc,
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-cudart",
        "static",
        "-lineinfo",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-I",
        os.path.join(_ROOT, "csrc"),
        *extra,
        *sources,
        "-o",
        output,
    ]


def build_stamp(cmd: list[str]) -> str:
    """SHA-256 of every file under ``csrc/`` (paths and bytes) and of the nvcc command ``cmd``."""
    digest = hashlib.sha256("\0".join(cmd[1:]).encode())
    csrc = os.path.join(_ROOT, "csrc")
    for path in sorted(glob.glob(os.path.join(csrc, "**", "*"), recursive=True)):
        if not os.path.isfile(path):
            continue
        digest.update(os.path.relpath(path, csrc).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _stamp_path(output: str) -> str:
    return output + ".sha256"


def is_up_to_date(output: str, stamp: str) -> bool:
    """``output`` exists and was built from exactly these sources and flags."""
    try:
        with open(_stamp_path(output), encoding="ascii") as f:
            return os.path.isfile(output) and f.read().strip() == stamp
    except OSError:
        return False


def build_kernels(output: str, required: bool = False, force: bool = False) -> str | None:
    """Build the kernel library at ``output`` (``ops.library.LIB_PATH`` is where it loads from) unless it is up
    to date (``force``: always); returns its path, or None when there is nothing to build with.

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
    stamp = build_stamp(cmd)
    if not force and is_up_to_date(output, stamp):
        print(f"[moe_ep_plugin] kernel library up to date (csrc/ unchanged): {output}", flush=True)
        return output
    print("[moe_ep_plugin] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(_stamp_path(output), "w", encoding="ascii") as f:
        f.write(stamp + "\n")
    return output


if __name__ == "__main__":
    from .ops.library import LIB_PATH

    out = sys.argv[sys.argv.index("--output") + 1] if "--output" in sys.argv else LIB_PATH
    path = build_kernels(out, required="--required" in sys.argv, force="--force" in sys.argv)
    print(f"[moe_ep_plugin] kernel library: {path}")
