"""A decoder-only transformer whose MoE blocks follow DeepSeek-V3, with routed experts sharded over EP ranks.

B = sequences, S = sequence length, T = B*S local tokens, H = hidden, E = routed experts, K = top-k,
R = EP ranks, L = E / R local experts, F = expert inner width.

Blocks ``0 .. num_dense_layers-1`` use a dense SwiGLU MLP; the others an MoE MLP: one (or more) always-on shared
expert(s) plus E routed experts picked by group-limited gating (``moe_ep_plugin.gating``). Tokens travel to the
ranks owning their experts through ``moe_ep_plugin.autograd.dispatch_experts``, which lands them expert-major so
the local experts run as grouped matmuls over contiguous slices of the batched weights ``[L, ...]``
(``moe_ep_plugin.experts``), and the expert outputs come back through ``combine_experts``.

Weights are made so that they do not depend on the EP size: every replicated parameter comes from one seeded
generator in a fixed order, and routed expert ``e`` of block ``b`` from its own generator seeded by
``(seed, b, e)``. A model on R ranks therefore holds exactly the slices of the model on one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ... import autograd, experts, gating
from ...buffer import Buffer
from .config import TrainerConfig


@dataclass
class MoEStats:
    """What one forward's MoE blocks report: ``counts [num_moe_blocks, E]`` int64 tokens routed to each expert
    from this rank (detached), ``aux_loss`` (0-d, the summed sequence balance losses, differentiable) and
    ``routes``: each MoE block's ``topk_idx [T, K]`` (detached; the trainer's node statistics)."""

    counts: torch.Tensor
    aux_loss: torch.Tensor
    routes: list[torch.Tensor]


def _normal(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class SwiGLU(nn.Module):
    """``x [*, H]`` → ``W_down (silu(x W_gate) * (x W_up))`` ``[*, H]``."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Attention(nn.Module):
    """Causal multi-head self-attention (torch SDPA) with rotary position embeddings."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``x [B, heads, S, D]``: channel pairs (i, i + D/2) rotate by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RoutedExperts(nn.Module):
    """The L routed experts this rank owns, as batched SwiGLU weights ``gate_up [L, H, 2F]``, ``down [L, F, H]``.

    ``forward(x [M, H], tokens_per_expert list[int] of length L summing to M)``: rows are expert-major
    (``dispatch_experts``' layout); ``impl`` (``moe.expert_compute``) picks torch's grouped matmul or one matmul
    per expert (``moe_ep_plugin.experts``).
    """

    def __init__(self, num_local: int, hidden: int, inner: int, impl: str = "auto") -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_local, hidden, 2 * inner))
        self.down = nn.Parameter(torch.empty(num_local, inner, hidden))
        self.impl = impl

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        # under autocast the weights are cast once here, so both paths multiply in the compute dtype
        dtype = x.dtype
        return experts.swiglu_experts(x, self.gate_up.to(dtype), self.down.to(dtype), tokens_per_expert, self.impl)


class MoEMLP(nn.Module):
    """DeepSeek-V3 MoE MLP: shared expert(s) on every token + top-K routed experts exchanged over the EP group.

    ``expert_bias [E]`` (float32 buffer, identical on every rank) steers selection only; the trainer updates it
    from the globally summed loads after each step.
    """

    def __init__(self, cfg: TrainerConfig, ep_rank: int, ep_size: int) -> None:
        super().__init__()
        m, e = cfg.model, cfg.moe
        self.cfg = e
        self.num_experts = e.num_experts
        self.num_local = e.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local
        self.router = nn.Parameter(torch.empty(e.num_experts, m.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(e.num_experts), persistent=True)
        self.shared = (
            SwiGLU(m.hidden_size, e.expert_ffn_hidden_size * e.num_shared_experts) if e.num_shared_experts else None
        )
        self.experts = RoutedExperts(self.num_local, m.hidden_size, e.expert_ffn_hidden_size, e.expert_compute)
        self.buffer: Buffer | None = None  # set by MoETransformer.attach (not a module: never saved)
        self.fp8_dispatch = cfg.parallel.fp8_dispatch

    def route(self, tokens: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``tokens [T, H]`` (batch-major: token ``b*S + s``) → ``(topk_weights [T, K] fp32, topk_idx [T, K],
        sequence aux loss 0-d)``; the router runs in fp32."""
        e = self.cfg
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.router.float())
            grouped = e.num_groups > 1
            weights, idx = gating.group_limited_topk(
                logits,
                e.topk,
                score_function=e.score_function,
                use_pre_softmax=e.use_pre_softmax,
                num_groups=e.num_groups if grouped else None,
                group_topk=e.group_topk if grouped else None,
                scaling_factor=e.scaling_factor,
                expert_bias=self.expert_bias if e.expert_bias else None,
            )
            if e.seq_aux_loss_coeff > 0:
                # gating's sequence loss reads tokens sequence-position-major ([S, B] flattened).
                seq_major = logits.view(batch, -1, self.num_experts).transpose(0, 1).reshape(-1, self.num_experts)
                scores, routing_map = gating.aux_loss_scores(seq_major, e.topk, score_function=e.score_function)
                aux = gating.sequence_aux_loss(
                    scores, routing_map, topk=e.topk, batch_size=batch, coeff=e.seq_aux_loss_coeff
                )
            else:
                aux = logits.new_zeros(())
        return weights, idx, aux

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, S, H]`` → ``(y [B, S, H], topk_idx [B*S, K] detached, aux_loss 0-d)``."""
        if self.buffer is None:
            raise RuntimeError("MoEMLP: no Buffer attached (call MoETransformer.attach(buffer) first)")
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        weights, idx, aux = self.route(tokens, b)
        compute_dtype = (
            torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else tokens.dtype
        )
        rows, probs, counts, handle = autograd.dispatch_experts(
            self.buffer, tokens.to(compute_dtype), idx, weights, self.num_experts, fp8_dispatch=self.fp8_dispatch
        )
        expert_out = self.experts(rows.to(compute_dtype), counts) * probs.unsqueeze(1).to(compute_dtype)
        # combine_experts sums each received row's routes in fp32 and sends them in the compute dtype (BF16 on GPU).
        y = autograd.combine_experts(self.buffer, expert_out, handle)
        if self.shared is not None:
            y = y + self.shared(tokens)
        return y.view(b, s, h), idx.detach(), aux


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``+ mlp(norm(x))`` (dense or MoE)."""

    def __init__(self, cfg: TrainerConfig, moe: bool, ep_rank: int, ep_size: int) -> None:
        super().__init__()
        m = cfg.model
        self.attn_norm = nn.RMSNorm(m.hidden_size, eps=1e-6)
        self.attn = Attention(m.hidden_size, m.num_heads)
        self.mlp_norm = nn.RMSNorm(m.hidden_size, eps=1e-6)
        self.mlp = MoEMLP(cfg, ep_rank, ep_size) if moe else SwiGLU(m.hidden_size, m.ffn_hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``x [B, S, H]`` → ``(x [B, S, H], topk_idx [B*S, K] or None, aux loss or None)`` (None: dense block)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if isinstance(self.mlp, MoEMLP):
            y, idx, aux = self.mlp(self.mlp_norm(x))
            return x + y, idx, aux
        return x + self.mlp(self.mlp_norm(x)), None, None


class MoETransformer(nn.Module):
    """Token ids ``[B, S]`` int64 → logits ``[B, S, vocab]`` (float32) and :class:`MoEStats`."""

    def __init__(self, cfg: TrainerConfig, ep_rank: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg, i >= m.num_dense_layers, ep_rank, ep_size) for i in range(m.num_layers))
        self.norm = nn.RMSNorm(m.hidden_size, eps=1e-6)
        self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        head_dim = m.hidden_size // m.num_heads
        inv_freq = 1.0 / m.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(m.seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def moe_layers(self) -> list[MoEMLP]:
        return [blk.mlp for blk in self.blocks if isinstance(blk.mlp, MoEMLP)]

    def attach(self, buffer: Buffer) -> None:
        """Use ``buffer`` (on the EP group) for every MoE block's dispatch/combine."""
        for layer in self.moe_layers():
            layer.buffer = buffer

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters owned by this rank alone (its routed experts); all others are replicated."""
        return [p for layer in self.moe_layers() for p in layer.experts.parameters()]

    def replicated_parameters(self) -> list[nn.Parameter]:
        owned = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in owned]

    @torch.no_grad()
    def initialize(self, seed: int) -> None:
        """Fill every weight from ``seed`` independently of the EP size (see the module docstring)."""
        std, layers = self.cfg.model.init_std, self.cfg.model.num_layers
        gen = torch.Generator().manual_seed(seed)
        experts = {id(p) for p in self.expert_parameters()}
        for name, p in self.named_parameters():
            if id(p) in experts:
                continue
            if p.dim() == 1:  # norm scales
                p.copy_(torch.ones_like(p))
                continue
            # Residual-branch outputs start smaller so the stream's variance does not grow with depth.
            scale = 1.0 / math.sqrt(2 * layers) if name.endswith(("out.weight", "down.weight")) else 1.0
            p.copy_(_normal(tuple(p.shape), std * scale, gen))
        for b, blk in enumerate(self.blocks):
            if not isinstance(blk.mlp, MoEMLP):
                continue
            layer = blk.mlp
            for local in range(layer.num_local):
                expert_seed = np.random.SeedSequence([seed, b, layer.first_expert + local]).generate_state(1)[0]
                g = torch.Generator().manual_seed(int(expert_seed))
                layer.experts.gate_up[local].copy_(_normal(tuple(layer.experts.gate_up.shape[1:]), std, g))
                down_std = std / math.sqrt(2 * layers)
                layer.experts.down[local].copy_(_normal(tuple(layer.experts.down.shape[1:]), down_std, g))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, MoEStats]:
        s = ids.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed(ids)
        counts, routes, aux = [], [], x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, idx, a = blk(x, cos, sin)
            if idx is not None:
                counts.append(gating.tokens_per_expert(idx, self.cfg.moe.num_experts, check_ids=False))
                routes.append(idx)
                aux = aux + a
        logits = self.head(self.norm(x)).float()
        stacked = torch.stack(counts) if counts else torch.zeros(0, self.cfg.moe.num_experts, dtype=torch.int64)
        return logits, MoEStats(counts=stacked, aux_loss=aux, routes=routes)
