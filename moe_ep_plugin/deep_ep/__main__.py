"""``python -m moe_ep_plugin.deep_ep``: print the directory to put first on ``PYTHONPATH`` so that ``import deep_ep``
resolves to this library (see ``install.py``)."""

from .install import SHADOW_DIR

print(SHADOW_DIR)
