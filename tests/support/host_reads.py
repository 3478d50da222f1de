"""A guard for the paths that must read nothing on the host: while inside :func:`no_host_reads`, every way a tensor
reaches a Python value raises ``AssertionError`` naming it (a host read of a device count, on a GPU a sync)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """While inside, each of ``HOST_READS`` on a tensor raises ``AssertionError`` naming it."""

    def refuse(name: str):
        def read(self, *args, **kwargs):
            raise AssertionError(f"host read: Tensor.{name}")

        return read

    with contextlib.ExitStack() as stack:
        for name in HOST_READS:
            stack.enter_context(mock.patch.object(torch.Tensor, name, refuse(name)))
        yield
