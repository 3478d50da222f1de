"""The built kernel library loads on this (CPU) machine with every C function the Python side declares, and the
ctypes parameter structs lay out exactly like the C header's.

CI builds ``csrc/`` before the tests, so a symbol dropped or renamed in C, an ABI version bump not mirrored in
``library.py``, or a struct field out of step fails here, not first on the GPU machine. Skips when the library has
not been built (or no C compiler exists, for the layout check).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from moe_ep_plugin.ops import library, permute


@pytest.mark.skipif(
    not os.path.isfile(library.library_path()), reason="kernel library not built (python -m moe_ep_plugin._build)"
)
def test_every_declared_function_is_exported() -> None:
    lib = library.load()  # raises on a missing symbol or an ABI mismatch
    assert lib.moe_ep_abi_version() == library.ABI_VERSION
    assert permute._kernels() is not None, "csrc/api.cu permute functions missing from the library"


def _c_compiler() -> str | None:
    return next((c for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c and shutil.which(c)), None)


@pytest.mark.skipif(_c_compiler() is None, reason="no C compiler to read the header's struct layout with")
@pytest.mark.parametrize(
    "struct, name",
    [
        (library.DispatchParams, "moe_ep_dispatch_params"),
        (library.CombineParams, "moe_ep_combine_params"),
        (library.LLDispatchParams, "moe_ep_ll_dispatch_params"),
        (library.LLCombineParams, "moe_ep_ll_combine_params"),
    ],
)
def test_parameter_structs_match_the_header(struct, name: str, tmp_path) -> None:
    """Every field of the ctypes mirror sits at the offset (and the struct has the size) the C compiler gives
    ``csrc/moe_ep.h``: a field added, dropped or reordered on one side only would hand the kernels garbage."""
    header = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "moe_ep.h")
    fields = [field for field, _ in struct._fields_]
    lines = [f'printf("%zu\\n", offsetof({name}, {field}));' for field in fields]
    source = tmp_path / "layout.c"
    source.write_text(
        f'#include <stddef.h>\n#include <stdio.h>\n#include "{header}"\nint main(void) {{\n'
        + "\n".join(lines)
        + f'\nprintf("%zu\\n", sizeof({name}));\nreturn 0;\n}}\n'
    )
    binary = tmp_path / "layout"
    subprocess.run([_c_compiler(), str(source), "-o", str(binary)], check=True, capture_output=True)
    got = [int(v) for v in subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()]
    want = [getattr(struct, field).offset for field in fields] + [ctypes.sizeof(struct)]
    assert got == want, [(f, g, w) for f, g, w in zip(fields + ["sizeof"], got, want, strict=False) if g != w]


def test_every_header_constant_is_mirrored_once() -> None:
    """Each ``#define MOE_EP_<NAME> <int>`` of ``csrc/moe_ep.h`` has its one Python copy (``ops.library.<NAME>``,
    or ``config.MAX_COPY_STREAMS``, which the leaf ``config`` validates ``NVLinkTuning`` with) of the same value,
    and no other module of the package defines one of those names again."""
    import re

    from moe_ep_plugin import config

    header = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "moe_ep.h")).read()
    defines = dict(re.findall(r"^#define MOE_EP_(\w+) (\d+)", header, re.M))
    assert "ABI_VERSION" in defines and "READ_BYTES" in defines
    homes = {"MAX_COPY_STREAMS": config}
    for name, value in defines.items():
        home = homes.get(name, library)
        assert getattr(home, name, None) == int(value), f"{home.__name__}.{name} != MOE_EP_{name} = {value}"
    package = os.path.dirname(os.path.dirname(os.path.abspath(library.__file__)))
    for directory, _, files in os.walk(package):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(directory, file)
            for name in re.findall(r"^_?([A-Z][A-Z0-9_]+) = \d", open(path).read(), re.M):
                if name in defines:
                    owner = homes.get(name, library)
                    assert os.path.samefile(path, owner.__file__), f"{path} defines {name} again"
