"""Helpers the tests share: plain-loop references, random drop-in rounds, bounded waits, GPU skip marks, Megatron's
host doubles and its EP-overlap schedule against the plain layer, a recording stand-in for the kernel library
(``fake_kernels``)."""
