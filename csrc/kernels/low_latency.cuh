#pragma once
// Device code of the low-latency dispatch/combine (DeepEP V1's decode kernels) on CUDA-IPC peer memory, launched
// from csrc/api.cu; layout and protocol in moe_ep.h. Fixed shapes, no host sync, so a call can be captured in a CUDA
// graph; each call is a send half and a receive half so that a hook can run the receive later (two micro-batches
// overlap).
//
// dispatch send: ll_pack_kernel writes this rank's tokens as messages (FP8-quantized on the way when asked) into
//   its own staging; ll::dispatch's send half (one block per global expert) gives every token choosing the expert
//   its position among this rank's tokens for it (a block scan in token order), stores the messages into the
//   owner's slots over NVLink, then publishes the count and a flag (release) in the owner's signals.
// dispatch recv: one block per local expert acquires every source's flag (timed), packs the rows by source rank
//   then token into recv_x / the column-major scales, and writes recv_count, src_info, layout_range, wait times.
// combine send: one block per (local expert, source rank) stores each row back into the source's combine slot
//   [global expert][token], then sets that source's flag for the expert.
// combine recv: one block per token acquires its experts' flags and sums weight * row over k in fp32; block 0
//   also waits for every expert's flag (a barrier, see the kernel).
// ll_advance_kernel then moves the set's call sequence on (all ranks alike). A rank that refused the call takes part
// without data, marked refused (moe_ep.h `refusal`).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "../common.cuh"
#include "../context.h"
#include "fp8.cuh"

namespace moe_ep {

constexpr int64_t kLLSignalBytes = 16384;  // sequence + 3 ints per expert, up to MOE_EP_MAX_EXPERTS experts
constexpr int kLLThreads = 512;
constexpr int kLLWarps = kLLThreads / 32;
static_assert(16 + 3 * 4 * int64_t(kMaxExperts) <= kLLSignalBytes, "low-latency signals too large");

struct LLShape {
    int64_t M, H, E, R, L, slot, set_bytes, comb_offset;
};

__host__ __device__ inline LLShape ll_shape(int64_t M, int64_t H, int64_t E, int64_t R) {
    LLShape s;
    s.M = M, s.H = H, s.E = E, s.R = R, s.L = E / R;
    s.slot = 16 + 2 * H;  // header + the larger of a BF16 row and an FP8 row with its scales
    s.comb_offset = kLLSignalBytes + E * M * s.slot;
    const int64_t comb = E * M * 2 * H > M * s.slot ? E * M * 2 * H : M * s.slot;
    s.set_bytes = s.comb_offset + comb;
    return s;
}

// Set `set` of rank `owner`'s buffer and its parts.
struct LLSet {
    char* base;
    __device__ int* seq() const { return reinterpret_cast<int*>(base); }
    // ranks that refused a call (bit mask) and the refusal word of one of them (csrc/moe_ep.h MOE_EP_ERR_REFUSED)
    __device__ int* refused() const { return reinterpret_cast<int*>(base) + 1; }
    __device__ int* refusal() const { return reinterpret_cast<int*>(base) + 2; }
    __device__ int* disp_count(const LLShape& s) const { return reinterpret_cast<int*>(base + 16); }
    __device__ int* disp_flag(const LLShape& s) const { return reinterpret_cast<int*>(base + 16) + s.E; }
    __device__ int* comb_flag(const LLShape& s) const { return reinterpret_cast<int*>(base + 16) + 2 * s.E; }
    __device__ char* disp_slot(const LLShape& s, int l, int src, int i) const {
        return base + kLLSignalBytes + ((int64_t(l) * s.R + src) * s.M + i) * s.slot;
    }
    __device__ char* comb_slot(const LLShape& s, int e, int t) const {
        return base + s.comb_offset + (int64_t(e) * s.M + t) * 2 * s.H;
    }
    __device__ char* staging(const LLShape& s, int t) const { return base + s.comb_offset + int64_t(t) * s.slot; }
};

__device__ __forceinline__ LLSet ll_set(const DevCtx& c, int owner, const LLShape& s, int set) {
    return LLSet{c.bufs[owner] + kStagingOffset + set * s.set_bytes};
}

// A refusing rank's mark in `peer`'s set, stored before the flags that publish it.
__device__ __forceinline__ void ll_mark_refused(const LLSet& peer, int rank, int64_t refusal) {
    atomicOr_system(peer.refused(), 1 << rank);
    *reinterpret_cast<volatile int*>(peer.refusal()) = int(refusal);
}

// After acquiring `src`'s flag: record MOE_EP_ERR_REFUSED when `src` marked itself refused.
__device__ __forceinline__ void ll_check_refused(const DevCtx& c, const LLSet& mine, int src) {
    const int mask = ld_volatile(mine.refused());
    if ((mask >> src) & 1) report_error(c, MOE_EP_ERR_REFUSED, mask, ld_volatile(mine.refusal()));
}

// Warp-wide copy of n 16-byte vectors; kPeerWritten: src was written by another GPU (coherent loads).
template <bool kPeerWritten>
__device__ __forceinline__ void ll_copy(int4* dst, const int4* src, int64_t n, int lane) {
    for (int64_t i = lane; i < n; i += 32) dst[i] = kPeerWritten ? ld_coherent(src + i) : __ldg(src + i);
}

// Kernel names: DeepEP's test harness (deep_ep.utils.testing.bench_kineto) times an operation by the one profiler
// line whose kernel name contains "dispatch" (or "combine") and, with the hook, by the launches named "::dispatch"
// per call. So each operation is one kernel, moe_ep::ll::dispatch / combine, launched for its send and its receive
// half (`recv`), and no other kernel's name (its parameter types included) contains either word.

// What the pack step of a dispatch reads (not the dispatch's parameter struct: see "Kernel names").
struct LLPack {
    const void* x;
    int64_t num_tokens, use_fp8, round_scale, buffer_set;
};

// ---- dispatch ----
__global__ void __launch_bounds__(256) ll_pack_kernel(DevCtx c, LLPack p, LLShape s) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (t >= p.num_tokens) return;
    char* msg = ll_set(c, c.rank, s, int(p.buffer_set)).staging(s, t);
    const __nv_bfloat16* row = static_cast<const __nv_bfloat16*>(p.x) + int64_t(t) * s.H;
    if (lane == 0) *reinterpret_cast<int4*>(msg) = make_int4(t, 0, 0, 0);
    if (p.use_fp8) {
        quantize_row<__nv_bfloat16>(row, int(s.H), reinterpret_cast<uint8_t*>(msg + 16),
                                    reinterpret_cast<float*>(msg + 16 + s.H), nullptr, nullptr, nullptr,
                                    p.round_scale != 0, lane);
    } else {
        ll_copy<false>(reinterpret_cast<int4*>(msg + 16), reinterpret_cast<const int4*>(row), s.H * 2 / 16, lane);
    }
}

__device__ __forceinline__ void ll_dispatch_send(const DevCtx& c, const moe_ep_ll_dispatch_params& p,
                                                 const LLShape& s) {
    __shared__ int scratch[33];
    __shared__ int tokens[kLLThreads];
    const int e = blockIdx.x, owner = int(e / s.L), l = int(e % s.L);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int set = int(p.buffer_set);
    const LLSet mine = ll_set(c, c.rank, s, set), peer = ll_set(c, owner, s, set);
    const int seq = ld_volatile(mine.seq()) + 1;
    const int64_t msg_vecs = (p.use_fp8 ? 16 + s.H + s.H / 32 + 15 : 16 + 2 * s.H) / 16;
    int sent = 0;
    for (int base = 0; base < p.num_tokens; base += kLLThreads) {
        const int t = base + threadIdx.x;
        int present = 0;
        if (t < p.num_tokens)
            for (int k = 0; k < p.num_topk; ++k) present |= p.topk_idx[int64_t(t) * p.num_topk + k] == e;
        int total;
        const int pos = block_exclusive_sum(present, scratch, total);
        if (present) tokens[pos] = t;
        __syncthreads();
        for (int j = warp; j < total; j += kLLWarps)
            ll_copy<false>(reinterpret_cast<int4*>(peer.disp_slot(s, l, c.rank, sent + j)),
                           reinterpret_cast<const int4*>(mine.staging(s, tokens[j])), msg_vecs, lane);
        sent += total;
        __syncthreads();
    }
    if (p.refusal != 0 && threadIdx.x == 0) ll_mark_refused(peer, c.rank, p.refusal);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        peer.disp_count(s)[l * s.R + c.rank] = sent;
        st_release_sys(&peer.disp_flag(s)[l * s.R + c.rank], seq);
    }
}

__device__ __forceinline__ void ll_dispatch_recv(const DevCtx& c, const moe_ep_ll_dispatch_params& p,
                                                 const LLShape& s) {
    __shared__ int counts[kMaxRanks], begins[kMaxRanks + 1], ok;
    const int l = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const LLSet mine = ll_set(c, c.rank, s, int(p.buffer_set));
    const int seq = ld_volatile(mine.seq()) + 1;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    const int src = threadIdx.x;
    if (src < s.R) {
        const uint64_t start = now_ns();
        if (!wait_flag<true>(c, &mine.disp_flag(s)[l * s.R + src], seq, MOE_EP_ERR_DISPATCH_TIMEOUT, src, l))
            ok = 0;
        else
            ll_check_refused(c, mine, src);
        // a count beyond the slots (never sent by a healthy peer) must not address outside them
        counts[src] = min(max(ld_volatile(&mine.disp_count(s)[l * s.R + src]), 0), int(s.M));
        if (p.wait_stats != nullptr)
            atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + src),
                      (unsigned long long)(now_ns() - start));
    }
    __syncthreads();
    if (!ok || p.refusal != 0) return;  // a refusing rank writes no outputs
    if (threadIdx.x == 0) {
        begins[0] = 0;
        for (int r = 0; r < s.R; ++r) begins[r + 1] = begins[r] + counts[r];
        p.recv_count[l] = begins[s.R];
    }
    __syncthreads();
    if (src < s.R) p.layout_range[l * s.R + src] = (int64_t(begins[src]) << 32) | int64_t(counts[src]);
    const int64_t rows = s.R * s.M, S = s.H / 128;
    for (int j = warp; j < begins[s.R]; j += kLLWarps) {
        int r = 0;
        while (j >= begins[r + 1]) ++r;
        const char* msg = mine.disp_slot(s, l, r, j - begins[r]);
        const int64_t row = int64_t(l) * rows + j;
        if (lane == 0) p.src_info[row] = ld_volatile(reinterpret_cast<const int*>(msg));
        if (!p.use_fp8) {
            ll_copy<true>(static_cast<int4*>(p.recv_x) + row * (2 * s.H / 16), reinterpret_cast<const int4*>(msg + 16),
                          2 * s.H / 16, lane);
            continue;
        }
        ll_copy<true>(static_cast<int4*>(p.recv_x) + row * (s.H / 16), reinterpret_cast<const int4*>(msg + 16),
                      s.H / 16, lane);
        const int* scales = reinterpret_cast<const int*>(msg + 16 + s.H);
        if (p.use_ue8m0) {
            for (int64_t w = lane; w < S / 4; w += 32) {
                uint32_t word = 0;
                for (int b = 0; b < 4; ++b)
                    word |= ((uint32_t(ld_volatile(scales + 4 * w + b)) >> 23) & 0xffu) << (8 * b);
                static_cast<int32_t*>(p.recv_scales)[(int64_t(l) * (S / 4) + w) * rows + j] = int32_t(word);
            }
        } else {
            for (int64_t w = lane; w < S; w += 32)
                static_cast<int32_t*>(p.recv_scales)[(int64_t(l) * S + w) * rows + j] = ld_volatile(scales + w);
        }
    }
}

// ---- combine ----
__device__ __forceinline__ void ll_combine_send(const DevCtx& c, const moe_ep_ll_combine_params& p, const LLShape& s) {
    const int l = int(blockIdx.x / s.R), dst = int(blockIdx.x % s.R);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int set = int(p.buffer_set);
    const LLSet mine = ll_set(c, c.rank, s, set), peer = ll_set(c, dst, s, set);
    const int seq = ld_volatile(mine.seq()) + 1;
    const int64_t range = p.refusal != 0 ? 0 : p.layout_range[l * s.R + dst];  // a refusing rank sends no rows
    const int begin = int(range >> 32), count = int(range & 0xffffffff);
    const int e = c.rank * int(s.L) + l;
    const int64_t rows = s.R * s.M;
    // A layout from a dispatch whose receive timed out is garbage: never let it address outside the slots.
    const int valid = begin >= 0 && count >= 0 && count <= s.M && begin + count <= rows ? count : 0;
    for (int i = warp; i < valid; i += kLLWarps) {
        const int64_t row = int64_t(l) * rows + begin + i;
        const int t = p.src_info[row];
        if (t < 0 || t >= s.M) continue;
        ll_copy<false>(reinterpret_cast<int4*>(peer.comb_slot(s, e, t)),
                       static_cast<const int4*>(p.x) + row * (2 * s.H / 16), 2 * s.H / 16, lane);
    }
    if (p.refusal != 0 && threadIdx.x == 0) ll_mark_refused(peer, c.rank, p.refusal);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) st_release_sys(&peer.comb_flag(s)[e], seq);
}

__device__ __forceinline__ void ll_combine_recv(const DevCtx& c, const moe_ep_ll_combine_params& p, const LLShape& s) {
    __shared__ int ok;
    const int t = blockIdx.x;
    const LLSet mine = ll_set(c, c.rank, s, int(p.buffer_set));
    const int seq = ld_volatile(mine.seq()) + 1;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    // Every rank's combine send flags every expert on every rank, so block 0 waiting for all of them makes the
    // receive a barrier: without it a rank whose tokens need no peer (or that has none) would run ahead into its
    // next dispatch and overwrite slots a peer's previous dispatch receive may still be reading.
    // It is also where a refusing rank's mark is found.
    if (blockIdx.x == 0)
        for (int e = threadIdx.x; e < s.E; e += blockDim.x) {
            if (!wait_flag<true>(c, &mine.comb_flag(s)[e], seq, MOE_EP_ERR_COMBINE_TIMEOUT, int(e / s.L), e))
                ok = 0;
            else
                ll_check_refused(c, mine, int(e / s.L));
        }
    if (t >= p.num_tokens) return;  // the barrier block of a rank without tokens
    const int64_t* idx = p.topk_idx + int64_t(t) * p.num_topk;
    if (threadIdx.x < p.num_topk) {
        const int64_t e = idx[threadIdx.x];
        if (e >= 0 && e < s.E) {  // ids out of range are skipped (not checked on the host: that would sync)
            const uint64_t start = now_ns();
            if (!wait_flag<true>(c, &mine.comb_flag(s)[e], seq, MOE_EP_ERR_COMBINE_TIMEOUT, int(e / s.L), int(e)))
                ok = 0;
            if (p.wait_stats != nullptr)
                atomicAdd(reinterpret_cast<unsigned long long*>(p.wait_stats + e / s.L),
                          (unsigned long long)(now_ns() - start));
        }
    }
    __syncthreads();
    if (!ok) return;
    for (int64_t v = threadIdx.x; v < s.H / 8; v += blockDim.x) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int k = 0; k < p.num_topk; ++k) {
            const int64_t e = idx[k];
            if (e < 0 || e >= s.E) continue;
            const float w = p.topk_weights[int64_t(t) * p.num_topk + k];
            const int4 y = ld_coherent(reinterpret_cast<const int4*>(mine.comb_slot(s, int(e), t)) + v);
            const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&y);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = __bfloat1622float2(b[i]);
                // product then sum, each rounded (no FMA): the torch form's fp32 arithmetic bit for bit
                acc[2 * i] = __fadd_rn(acc[2 * i], __fmul_rn(w, f.x));
                acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], __fmul_rn(w, f.y));
            }
        }
        int4* out = reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(p.out) + int64_t(t) * s.H);
        out[v] = Vec<__nv_bfloat16>::pack(acc);
    }
}

namespace ll {

// Each operation's one kernel (see "Kernel names"): its send half, or with `recv` its receive half.
__global__ void __launch_bounds__(kLLThreads) dispatch(DevCtx c, moe_ep_ll_dispatch_params p, LLShape s, int recv) {
    if (recv)
        ll_dispatch_recv(c, p, s);
    else
        ll_dispatch_send(c, p, s);
}

__global__ void __launch_bounds__(kLLThreads) combine(DevCtx c, moe_ep_ll_combine_params p, LLShape s, int recv) {
    if (recv)
        ll_combine_recv(c, p, s);
    else
        ll_combine_send(c, p, s);
}

}  // namespace ll

__global__ void ll_advance_kernel(int* seq) {
    *seq += 1;
}

}  // namespace moe_ep
