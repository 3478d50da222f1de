"""Token data: the shipped byte-level corpus or a user file, cut into deterministic random windows.

Every rank derives the same global batch from ``(seed, step)`` and takes its own slice, so the data of a step
does not depend on the EP size (R ranks of B sequences see exactly the R*B sequences one rank would) and
resuming at step ``n`` needs nothing but ``n``.
"""

from __future__ import annotations

import os
from importlib import resources

import numpy as np
import torch

CORPUS = "corpus.txt"
_TRAIN, _EVAL = 0, 1  # stream ids mixed into the sampling seed


def shipped_corpus_path() -> str:
    """Path of the text corpus shipped in ``moe_ep_plugin/data``."""
    return str(resources.files("moe_ep_plugin").joinpath("data", CORPUS))


def load_tokens(path: str | None, vocab_size: int, vocab_key: str = "model.vocab_size") -> np.ndarray:
    """1-D int64 token ids: ``.npy`` files hold ids (each < ``vocab_size``, the recipe's key ``vocab_key``); any
    other file is read as bytes."""
    path = shipped_corpus_path() if path is None else path
    if not os.path.isfile(path):
        raise ValueError(f"data.path: no such file {path!r}")
    if path.endswith(".npy"):
        ids = np.load(path, mmap_mode="r")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"data.path: {path} must hold a 1-D integer array, got {ids.dtype} {ids.shape}")
        ids = np.asarray(ids, dtype=np.int64)
    else:
        with open(path, "rb") as f:
            ids = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"data.path: token ids must lie in [0, {vocab_key}={vocab_size}), found [{ids.min()}, {ids.max()}]"
        )
    return ids


class TokenWindows:
    """Random ``seq_len + 1`` windows of a token array, split into a training head and an eval tail.

    ``batch(step, ...)`` → ``(inputs [B, S] int64, targets [B, S] int64)`` on ``device``: rank ``r`` of ``world``
    gets sequences ``r*B .. (r+1)*B-1`` of the step's global batch of ``world*B``.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, eval_fraction: float, seed: int, seq_key: str = "model.seq_len"
    ) -> None:
        """``seq_key`` names the recipe's sequence-length setting in errors."""
        n_eval = int(len(tokens) * eval_fraction)
        self.train = tokens[: len(tokens) - n_eval]
        self.eval = tokens[len(tokens) - n_eval :]
        self.seq_len, self.seed = seq_len, seed
        if len(self.train) <= seq_len + 1:
            raise ValueError(
                f"{seq_key}: {seq_len} tokens per sequence need a corpus longer than {len(self.train)} training tokens"
            )
        if n_eval and len(self.eval) <= seq_len + 1:
            raise ValueError(
                f"data.eval_fraction: the eval split holds {len(self.eval)} tokens, fewer than "
                f"{seq_key} + 2 = {seq_len + 2}"
            )

    @property
    def has_eval(self) -> bool:
        return len(self.eval) > 0

    def batch(
        self, step: int, micro_batch: int, rank: int, world: int, device: torch.device, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.train if split == "train" else self.eval
        stream = _TRAIN if split == "train" else _EVAL
        rng = np.random.default_rng([self.seed, stream, step])
        starts = rng.integers(0, len(tokens) - self.seq_len - 1, size=world * micro_batch)
        mine = starts[rank * micro_batch : (rank + 1) * micro_batch]
        windows = np.stack([tokens[s : s + self.seq_len + 1] for s in mine])
        windows = torch.from_numpy(windows).to(device)
        return windows[:, :-1], windows[:, 1:]
