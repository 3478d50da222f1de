"""The ``nvlink`` transport: custom CUDA kernels (``csrc/``) moving rows between the GPUs of one host.

``runtime``: the peer memory and the library calls on it; ``plan``: sizes and launch decisions (pure functions);
``state``: what a dispatch keeps for the calls that replay it; ``transport``: ``NVLinkTransport``'s dispatch and
combine on top of them.
"""

from .transport import NVLinkTransport

__all__ = ["NVLinkTransport"]
