"""The kernel library's Python face, and the only Python that touches ``csrc/``.

- ``library``: loads ``libmoe_ep_kernels.so`` and declares its C ABI (the ctypes mirror of ``csrc/moe_ep.h``).
- ``layout``: the dispatch layout from top-k expert ids (torch ops).
- ``routing``: Megatron-Core's routing map → top-k ids and weights (one kernel on CUDA).
- ``permute``: received rows ↔ the expert-major layout (kernels on CUDA, torch ops elsewhere).
- ``pad``: drop-and-pad's fixed-capacity layout: pair selection, row arrangement, token sums (one kernel each on
  CUDA, torch ops elsewhere).
- ``fp8``: per-token 1x128 FP8 block quantization (the reference the kernels match bit for bit).

Transports and integrations call these modules; only they and the nvlink transport's runtime call ``library``.
"""
