"""Greedy decoding with the example trainer's model, its MoE layers on low-latency mode, checked against the
normal-mode forward of the same model on the same Buffer. ``examples/decode_moe.py`` runs it from the command line.

Each step feeds one token per sequence (``--batch`` sequences per rank): attention reads a fixed-size KV cache,
and each MoE block sends its tokens with ``Buffer.low_latency_dispatch`` (FP8 when ``parallel.fp8_dispatch`` is on,
as in the normal-mode forward, else BF16), runs every local expert over its
whole fixed block of ``R * M`` rows (the masked grouped GEMM a decode kernel runs; rows past ``recv_count`` are
ignored by combine) and brings the outputs back with ``low_latency_combine`` (the routing weights applied there,
in fp32). Every shape is fixed and no step reads anything on the host, so on GPU with the peer-memory kernels a
step is captured once in a CUDA graph and replayed (``--cuda-graph``); on CPU (and with the collective form) it
runs eagerly. Then the decoded positions run again eagerly, each MoE block beside its normal-mode forward
(``dispatch_experts`` on the same Buffer) on the same input, and the two outputs must agree to the wire's rounding
(``BLOCK_TOLERANCE``); with a graph, this pass's logits must equal the replay's bit for bit. Last, the whole
sequence goes through the model's normal-mode forward and the decoded logits are compared (``LOGIT_TOLERANCE``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import Buffer
from ...ops import fp8
from . import config, trainer
from .model import Attention, MoEMLP, MoETransformer, _rotate

# Each MoE block's low-latency output against its normal-mode forward on the same input (so the same routing),
# relative to the largest output, by (model dtype, FP8 wire). Measured (CPU, configs/tiny.yaml and
# configs/ep2_h200.yaml at hidden 2048): float32 with the BF16 wire 3-4e-3 (the wire and the combine round to BF16);
# with the FP8 wire 1.7-2.4e-2 (the low-latency path quantizes BF16-rounded rows, the normal one float32 rows, so
# some FP8 values round the other way); a BF16 model 6.6e-3. Dropping one local expert's output gives 0.39-0.9.
BLOCK_TOLERANCE = {
    (torch.float32, False): 1e-2,
    (torch.float32, True): 6e-2,
    (torch.bfloat16, False): 3e-2,
    (torch.bfloat16, True): 6e-2,
}
# End to end the logits agree only where both paths round alike to BF16 (float32 model, BF16 wire: 1.1-1.2e-3 on
# CPU and H200). Elsewhere a rounding difference in one block flips a near-tie in a later router, and the logits
# then differ by as much as dropping an expert (configs/ep2_h200.yaml: 0.11 with the FP8 wire, 0.21 in BF16, 0.17
# with one expert dropped), so they are reported, not checked.
LOGIT_TOLERANCE = {(torch.float32, False): 2e-3}


def cached_attention(
    attn: Attention,
    x: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence: ``x [B, 1, H]`` at position ``pos`` (``[1]`` int64 on the device) → ``[B, 1, H]``,
    its key and value written into ``cache`` (``[B, heads, S_max, D]`` each); positions after ``pos`` are masked."""
    b, _, h = x.shape
    q, k, v = attn.qkv(x).view(b, 1, 3, attn.heads, h // attn.heads).permute(2, 0, 3, 1, 4)
    c, s = cos.index_select(0, pos), sin.index_select(0, pos)
    q, k = _rotate(q, c, s), _rotate(k, c, s)
    keys, values = cache
    keys.index_copy_(2, pos, k)
    values.index_copy_(2, pos, v)
    visible = (torch.arange(keys.shape[2], device=x.device) <= pos).view(1, -1)  # [1 query, S_max keys]
    y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
    return attn.out(y.transpose(1, 2).reshape(b, 1, h))


def low_latency_moe(layer: MoEMLP, x: torch.Tensor, buffer: Buffer, max_tokens: int) -> torch.Tensor:
    """``x [B, 1, H]`` → the MoE block's output ``[B, 1, H]`` through low-latency dispatch/combine."""
    b, _, h = x.shape
    tokens = x.reshape(b, h)
    weights, idx, _ = layer.route(tokens, b)
    # the dispatch wire the normal-mode forward uses too (parallel.fp8_dispatch), so the two differ in rounding only
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(
        tokens.bfloat16(), idx, max_tokens, layer.num_experts, use_fp8=layer.fp8_dispatch
    )
    experts = layer.experts
    if layer.fp8_dispatch:
        q, scales = recv_x  # [L, R*M, H] e4m3, [L, R*M, H/128] float32
        rows = fp8.dequantize(q.reshape(-1, h), scales.reshape(-1, h // 128), experts.gate_up.dtype).view(q.shape)
    else:
        rows = recv_x.to(experts.gate_up.dtype)  # [L, R*M, H]
    gate, up = torch.bmm(rows, experts.gate_up).chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, experts.down)
    combined, _, _ = buffer.low_latency_combine(y.bfloat16(), idx, weights, handle)
    out = combined.to(x.dtype)
    if layer.shared is not None:
        out = out + layer.shared(tokens)
    return out.view(b, 1, h)


class Decoder:
    """Fixed-shape decode steps of ``model`` for ``batch`` sequences: ``step()`` reads ``self.ids [B]`` and
    ``self.pos [1]`` and writes ``self.logits [B, vocab]`` float32 (static tensors, so a CUDA graph can replay it)."""

    def __init__(self, model: MoETransformer, buffer: Buffer, batch: int) -> None:
        m = model.cfg.model
        self.model, self.buffer = model, buffer
        dev = model.head.weight.device
        dtype = model.head.weight.dtype
        shape = (batch, m.num_heads, m.seq_len, m.hidden_size // m.num_heads)
        self.caches = [
            (torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
            for _ in model.blocks
        ]
        self.ids = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(batch, m.vocab_size, dtype=torch.float32, device=dev)
        self.max_tokens = batch

    @torch.no_grad()
    def step(self, check: bool = False) -> float:
        """One decode step. With ``check`` (eager only: the normal-mode dispatch reads counts on the host) every MoE
        block also runs its normal-mode forward on the same input; returns the largest ``max |low-latency -
        normal| / max |normal|`` over the blocks (0.0 without ``check``)."""
        model = self.model
        worst = 0.0
        x = model.embed(self.ids).unsqueeze(1)
        for blk, cache in zip(model.blocks, self.caches, strict=True):
            x = x + cached_attention(blk.attn, blk.attn_norm(x), cache, self.pos, model.rope_cos, model.rope_sin)
            h = blk.mlp_norm(x)
            if isinstance(blk.mlp, MoEMLP):
                y = low_latency_moe(blk.mlp, h, self.buffer, self.max_tokens)
                if check:
                    want = blk.mlp(h)[0]
                    worst = max(worst, float((y - want).abs().max() / want.abs().max()))
            else:
                y = blk.mlp(h)
            x = x + y
        self.logits.copy_(model.head(model.norm(x))[:, 0].float())
        return worst


def decode(
    cfg: config.TrainerConfig, batch: int, prompt_len: int, new_tokens: int, cuda_graph: bool
) -> tuple[float, float]:
    """Feed a random prompt, decode ``new_tokens`` greedily, compare with the normal-mode forward; returns
    ``(MoE block difference, logit difference)``, each relative to the largest value. Rank 0 prints every rank's
    row and a PASS/FAIL line; every rank raises when any rank is above ``BLOCK_TOLERANCE``, or above
    ``LOGIT_TOLERANCE`` where it has an entry."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = trainer.resolve_device(cfg)
    dtype = trainer.resolve_dtype(cfg, device)
    m = cfg.model
    if prompt_len + new_tokens > m.seq_len:
        raise ValueError(
            f"--prompt-len + --new-tokens: at most model.seq_len={m.seq_len} positions, got {prompt_len + new_tokens}"
        )
    buffer = _low_latency_buffer(cfg, batch, world, dtype, cuda_graph)
    model = MoETransformer(cfg, rank, world)
    model.initialize(cfg.train.seed)
    model.to(device=device, dtype=dtype).eval()
    model.attach(buffer)
    decoder = Decoder(model, buffer, batch)
    gen = torch.Generator().manual_seed(cfg.train.seed + rank)
    ids = torch.randint(0, m.vocab_size, (batch, prompt_len), generator=gen).to(device)
    graph = _capture(decoder) if cuda_graph and device.type == "cuda" else None
    positions = prompt_len + new_tokens - 1
    ids, got = _generate(decoder, graph, ids, prompt_len, positions)
    # The same positions again, eagerly, each MoE block beside its normal-mode forward on the same input (same
    # routing): the low-latency path's own error, which later routers cannot amplify.
    block, eager = _rerun_checked(decoder, ids, positions)
    replay = float((eager - got).abs().max()) if graph is not None else float("nan")
    with torch.no_grad():
        reference, _ = model(ids[:, :-1])  # normal mode (dispatch_experts) on the same Buffer
    logits = float((got - reference).abs().max() / reference.abs().max())
    _report(
        block,
        logits,
        replay,
        dtype,
        cfg.parallel.fp8_dispatch,
        graph is not None,
        (batch, prompt_len, new_tokens),
        device,
    )
    return block, logits


def _low_latency_buffer(
    cfg: config.TrainerConfig, batch: int, world: int, dtype: torch.dtype, cuda_graph: bool
) -> Buffer:
    """The Buffer of both modes: normal-mode peer memory for ``dtype`` rows, low-latency slots for ``batch``
    tokens per rank; ``cuda_graph`` needs the nvlink transport."""
    m = cfg.model
    hidden_bytes = m.hidden_size * max(dtype.itemsize, 2)
    buffer = Buffer(
        num_nvl_bytes=trainer.nvl_bytes_hint(world, hidden_bytes),
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(batch, m.hidden_size, world, cfg.moe.num_experts),
        low_latency_mode=True,
        num_qps_per_rank=cfg.moe.num_experts // world,
        transport=cfg.parallel.transport,
        timeout_s=cfg.parallel.timeout_s,
    )
    if cuda_graph and buffer.transport_name != "nvlink":
        raise ValueError(
            "--cuda-graph: needs the nvlink transport's low-latency kernels (the collective form reads "
            "its header on the host)"
        )
    return buffer


def _capture(decoder: Decoder) -> torch.cuda.CUDAGraph:
    """One decode step captured in a CUDA graph (after a warm-up step outside the capture: allocations, lazy
    initialisation)."""
    decoder.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decoder.step()
    return graph


def _generate(
    decoder: Decoder, graph: torch.cuda.CUDAGraph | None, ids: torch.Tensor, prompt_len: int, positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed ``ids [B, prompt_len]`` one position at a time (the graph's replay, else an eager step), appending the
    greedy token from the prompt's last position on → ``(ids [B, positions + 1], logits [B, positions, vocab])``."""
    decoded = []
    for pos in range(positions):
        decoder.ids.copy_(ids[:, pos])
        decoder.pos.fill_(pos)
        graph.replay() if graph is not None else decoder.step()
        decoded.append(decoder.logits.clone())
        if pos + 1 >= prompt_len:
            ids = torch.cat([ids, decoder.logits.argmax(dim=1, keepdim=True)], dim=1)
    return ids, torch.stack(decoded, dim=1)


def _rerun_checked(decoder: Decoder, ids: torch.Tensor, positions: int) -> tuple[float, torch.Tensor]:
    """Eager steps over ``ids``' first ``positions``, each MoE block checked against its normal-mode forward →
    ``(largest block difference, logits [B, positions, vocab])``."""
    block, eager = 0.0, []
    for pos in range(positions):
        decoder.ids.copy_(ids[:, pos])
        decoder.pos.fill_(pos)
        block = max(block, decoder.step(check=True))
        eager.append(decoder.logits.clone())
    return block, torch.stack(eager, dim=1)


def _report(
    block: float,
    logits: float,
    replay: float,
    dtype: torch.dtype,
    wire: bool,
    graph: bool,
    shape: tuple[int, int, int],
    device: torch.device,
) -> None:
    """Every rank's row on rank 0, which prints one table in rank order and the verdict; every rank raises alike.
    ``shape``: ``(sequences, prompt length, new tokens)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor(
        [block, logits, replay], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu"
    )
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    failures = [f for r, row in enumerate(rows) for f in _failures(r, *row.tolist(), dtype, wire, graph)]
    if rank == 0:
        batch, prompt_len, new_tokens = shape
        print(
            f"{'rank':>4} {'seqs':>4} {'prompt':>6} {'new':>4} {'graph':>5} {'MoE block':>9} {'logits':>8} "
            f"{'replay-eager':>12}"
        )
        for r, row in enumerate(rows):
            b, lg, rp = row.tolist()
            print(f"{r:>4} {batch:>4} {prompt_len:>6} {new_tokens:>4} {str(graph):>5} {b:>9.2e} {lg:>8.2e} {rp:>12.2e}")
        print(
            "FAIL: " + "; ".join(failures)
            if failures
            else f"PASS: {world} ranks, every MoE block within {BLOCK_TOLERANCE[dtype, wire]:g} of its normal-mode "
            "forward"
            + (f", logits within {LOGIT_TOLERANCE[dtype, wire]:g}" if (dtype, wire) in LOGIT_TOLERANCE else ""),
            flush=True,
        )
    if failures:
        raise AssertionError("; ".join(failures))


def _failures(
    rank: int, block: float, logits: float, replay: float, dtype: torch.dtype, wire: bool, graph: bool
) -> list[str]:
    """Why ``rank``'s decode fails its checks (empty when it passes)."""
    failures = []
    if block > BLOCK_TOLERANCE[dtype, wire]:
        failures.append(
            f"rank {rank}: a low-latency MoE block differs from its normal-mode forward by {block:.2e} of "
            f"its largest output (tolerance {BLOCK_TOLERANCE[dtype, wire]})"
        )
    if graph and replay != 0.0:  # the same kernels on the same inputs: bit for bit
        failures.append(f"rank {rank}: the CUDA-graph replay's logits differ from the eager steps' by {replay:.2e}")
    if (dtype, wire) in LOGIT_TOLERANCE and logits > LOGIT_TOLERANCE[dtype, wire]:
        failures.append(
            f"rank {rank}: low-latency decode differs from the normal-mode forward by {logits:.2e} of "
            f"the largest logit (tolerance {LOGIT_TOLERANCE[dtype, wire]})"
        )
    return failures
