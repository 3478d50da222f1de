"""``import deep_ep`` → ``moe_ep_plugin.deep_ep``: this directory's parent goes first on ``PYTHONPATH``
(``python -m moe_ep_plugin.deep_ep`` prints it). Refuses when a real DeepEP is importable, unless
``MOE_EP_DEEP_EP_FORCE=1``."""

import os

from moe_ep_plugin.deep_ep.install import install_deep_ep

__moe_ep_shadow__ = True  # install_deep_ep replaces this module in sys.modules; it is not a real DeepEP
install_deep_ep(force=os.environ.get("MOE_EP_DEEP_EP_FORCE") == "1")
