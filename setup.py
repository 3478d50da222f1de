"""Build script: pure-Python install everywhere; the CUDA kernel library is compiled when nvcc exists."""

from __future__ import annotations

import importlib.util
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, *path: str):
    # Load a stdlib-only module of the package by path, so this works before torch is installed.
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, "moe_ep_plugin", *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """Compiles csrc/ into moe_ep_plugin/lib/ with nvcc (when present) before collecting package files."""

    def run(self) -> None:
        if os.environ.get("MOE_EP_SKIP_KERNELS", "0") != "1":
            library_path = _load("_moe_ep_library", "ops", "library.py").LIB_PATH
            _load("_moe_ep_build", "_build.py").build_kernels(library_path, required=False)
        super().run()


setup(
    name="moe_ep_plugin",
    version="0.1.0",
    description="Expert-parallel dispatch/combine for MoE training "
    "(DeepEP-compatible Buffer, Megatron-Core and DeepSpeed plugins)",
    packages=find_packages(include=["moe_ep_plugin", "moe_ep_plugin.*"]),
    package_data={"moe_ep_plugin": ["lib/*.so", "data/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "pyyaml", "tqdm"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout"],
        "megatron": ["megatron-core>=0.16", "triton", "einops"],
        "deepspeed": ["deepspeed>=0.16"],
        # DeepSpeed AutoEP's model test and example: the DeepSpeed tested and the transformers range it runs with
        "autoep": _load("_moe_ep_autoep_versions", "deepspeed", "autoep_versions.py").autoep_requirements(),
        "plots": ["matplotlib"],
    },
    entry_points={
        "console_scripts": [
            "moe-ep-train=moe_ep_plugin.recipes.train.cli:main",
            "moe-ep-pretrain=moe_ep_plugin.recipes.megatron.pretrain:main",
        ]
    },
    cmdclass={"build_py": BuildPyWithKernels},
)
