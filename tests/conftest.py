"""Shared test settings: CPU-only runs keep torch to one thread per rank so multi-rank tests fit on 2 cores."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
