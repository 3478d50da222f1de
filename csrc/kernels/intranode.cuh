#pragma once
// Device code of the NVLink kernels for the ranks of one host: notify (barrier + count exchange + send order),
// dispatch and combine (launched from csrc/api.cu).
//
// Push model with worst-case sized staging: every rank owns one region per source rank in its peer-visible
// buffer. A sender warp writes a chunk of kChunkRows rows straight into the destination's region (NVLink
// stores), then publishes the chunk by storing the operation's sequence id into a per-(source, chunk) flag
// with release semantics. Receiver warps of the destination acquire the flag and copy the rows into the
// output tensors. Sender and receiver warps share each block, so sending and receiving overlap. Rows a rank
// keeps for itself never touch the staging area. Regions are sized for the worst case, so senders never wait; a
// barrier at the start of every operation guarantees the previous operation's readers are done.
// Expert-major mode: instead of local expert ids, every sender ships each row's destination rows in the
// receiver's expert-major (grouped-GEMM) layout, known to it from notify's per-expert count exchange; receivers
// record them (recv_slot) and the weights at those rows, and an all-SM permute kernel expands the rows after.
// (Expanding inside this kernel was measured slower: 24 SMs cannot write the K-fold rows at HBM speed; a fused
// expansion mode that did so is in git tag pre-structure-2026-12-05, docs/kernels.md.)
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "../common.cuh"
#include "../moe_ep.h"
#include "fp8.cuh"
#include "permute.cuh"

namespace moe_ep {

constexpr int kThreads = 512;  // 16 warps per block, one block per SM
constexpr int kWarps = kThreads / 32;
constexpr int kNotifyThreads = 1024;

// Byte layout of one staged dispatch row: hidden payload, FP8 scales, local top-k ids, weights, source index.
struct SlotLayout {
    int payload_bytes, num_scales, scales_off, idx_off, w_off, src_off, slot_bytes;
};

__device__ __forceinline__ int rows_from(const int32_t* rpm, int R, int src, int dst) {
    return rpm[src * R + dst] - (src > 0 ? rpm[(src - 1) * R + dst] : 0);
}
__device__ __forceinline__ int offset_from(const int32_t* rpm, int R, int src, int dst) {
    return src > 0 ? rpm[(src - 1) * R + dst] : 0;
}

// Where a row's local copy goes (the copy helpers below call each(f) with the destination's (head, tail)):
// OneRow: one output row at `head` (null: none) whose tail part (an FP8 row's scales) lives at `tail`. scales() is
// the destination's tail as a row of its own.
struct OneRow {
    char* head;
    char* tail;
    __device__ __forceinline__ bool any() const { return head != nullptr; }
    // no row, no scales: `tail` may be computed from row -1 (a token whose own row another warp writes)
    __device__ __forceinline__ OneRow scales() const { return {head != nullptr ? tail : nullptr, nullptr}; }
    template <typename F>
    __device__ __forceinline__ void each(F&& f) const {
        if (head != nullptr) f(head, tail);
    }
};
// Warp-wide copy of n 16-byte vectors from src to `wire` (may be null) and to the destination of `out`. Each lane
// keeps kCopyBatch loads in flight (guarded, so short rows and row tails cost one memory latency per batch, not per
// vector): copies are latency-bound, not issue-bound. The loads land in the warp's `stage` (kStageVecs vectors of
// shared memory) by cp.async, not in registers: a batch in registers (64 per thread) made the kernels spill.
// A row may come in two parts: vectors from `n_head` on are read from `src_tail` and written to the destination's
// tail (when it has one) instead of following on from src / its head, e.g. an FP8 row's scales, which follow its
// payload in a staging slot but have their own input and output tensors: one batch of loads serves both parts.
constexpr int kCopyBatch = 16;
constexpr int kStageVecs = 32 * kCopyBatch;                           // one warp's stage
constexpr int kStageBytes = kWarps * kStageVecs * int(sizeof(int4));  // the stages of a block's warps
template <typename Out>
__device__ __forceinline__ void copy_row(int4* stage, int4* wire, const Out& out, const int4* src, int n, int lane,
                                         int n_head = -1, const int4* src_tail = nullptr) {
    if (n_head < 0) n_head = n;
#pragma unroll 1
    for (int base = lane; base < n; base += 32 * kCopyBatch) {
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u) {
            const int j = base + 32 * u;
            if (j < n)
                cp_async16(stage + 32 * u + lane,
                           j < n_head || src_tail == nullptr ? src + j : src_tail + (j - n_head));
        }
        cp_async_wait_all();
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u) {
            const int j = base + 32 * u;
            if (j >= n) break;
            // every store of this vector follows its shared-memory load, so the next batch's cp.async cannot
            // overwrite the slot before it was read
            const int4 v = stage[32 * u + lane];
            if (wire != nullptr) wire[j] = v;
            out.each([&](char* head, char* tail) {
                int4* row = reinterpret_cast<int4*>(head);
                int4* row_tail = reinterpret_cast<int4*>(tail);
                *(j < n_head || row_tail == nullptr ? row + j : row_tail + (j - n_head)) = v;
            });
        }
    }
}

// Pulls rows x[t] (row_bytes each) into L2 for every set bit i of `rows` (lane i holds t), so the per-row copies
// or quantization that follow wait on L2 rather than on HBM latency; costs no registers.
__device__ __forceinline__ void prefetch_rows(const char* x, int64_t row_bytes, int t, uint32_t rows, int lane) {
    const int lines = int((row_bytes + 127) / 128);
    for (uint32_t m = rows; m != 0; m &= m - 1) {
        const char* row = x + int64_t(__shfl_sync(0xffffffffu, t, __ffs(int(m)) - 1)) * row_bytes;
        for (int l = lane; l < lines; l += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + int64_t(l) * 128));
    }
}

// The same as copy_row for the n floats of a row's FP8 scales.
template <bool kPeerWritten, typename Out>
__device__ __forceinline__ void copy_floats(float* wire, const Out& out, const float* src, int n, int lane) {
    for (int i = lane; i < n; i += 32) {
        const float v = kPeerWritten ? *reinterpret_cast<const volatile float*>(src + i) : __ldg(src + i);
        if (wire != nullptr) wire[i] = v;
        out.each([&](char* head, char*) { reinterpret_cast<float*>(head)[i] = v; });
    }
}

// Warp-wide dequantization of one FP8 row into the OutT row of `out` (16 bytes per lane per step, kCopyBatch steps
// in flight through the warp's `stage`, as in copy_row).
template <bool kPeerWritten, typename OutT, typename Out>
__device__ __forceinline__ void dequant_row(int4* stage, const uint8_t* q, const float* scales, const Out& out,
                                            int hidden, int lane) {
#pragma unroll 1
    for (int base = lane * 16; base < hidden; base += 512 * kCopyBatch) {
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u)
            if (base + 512 * u < hidden)
                cp_async16(stage + 32 * u + lane, reinterpret_cast<const int4*>(q + base + 512 * u));
        cp_async_wait_all();
#pragma unroll
        for (int u = 0; u < kCopyBatch; ++u) {
            const int c0 = base + 512 * u;
            if (c0 >= hidden) break;
            const float s =
                kPeerWritten ? *reinterpret_cast<const volatile float*>(scales + c0 / 128) : __ldg(scales + c0 / 128);
            int4 o[sizeof(OutT)];
            dequant16<OutT>(stage[32 * u + lane], s, o);
            out.each([&](char* head, char*) { store16(reinterpret_cast<OutT*>(head) + c0, o); });
        }
    }
}

// Publish a chunk the whole warp wrote into a peer's region: the warp barrier orders every lane's stores before
// lane 0's system-scope release store of the flag, which (being cumulative) makes them visible on the peer before
// the flag. (A sequentially consistent fence before it orders more than the flag needs, and measured slower.)
__device__ __forceinline__ void publish(int* flag, int seq, int lane) {
    __syncwarp();
    if (lane == 0) {
        st_release_sys(flag, seq);
    }
}

// How the rows of one transfer arrive: the first `copied` by copy engine in pieces of `piece` rows, each flagged 1
// when it landed; the rest by SM senders in chunks, each flagged with the operation's sequence id.
struct Arrival {
    int copied, piece;
};
__device__ __forceinline__ Arrival arrival_of(int count, bool copy_engine, int min_piece_rows) {
    const int copied = copied_rows(count, copy_engine);
    return {copied, piece_rows(copied, min_piece_rows)};
}
constexpr int kNotSeen = 1 << 30;

// Waits until the row at position `pos` of the transfer from `src` has landed in this rank's region. Returns
// false (after reporting) on timeout or abort. `seen` caches the last flag waited for (kNotSeen at first).
__device__ __forceinline__ bool wait_rows(const DevCtx& c, int src, int pos, const Arrival& a, int seq, int code,
                                          int& seen, int lane) {
    const bool copied = pos < a.copied;
    const int unit = copied ? pos / a.piece : pos / kChunkRows;
    const int key = copied ? -1 - unit : unit;
    if (key == seen) return true;
    seen = key;
    int ok = 1;
    char* mine = c.bufs[c.rank];
    if (lane == 0)
        ok = copied ? wait_flag<false>(c, &copy_flags(mine)->arrived[src][unit], 1, code, src, unit)
                    : wait_flag<false>(c, flags(mine, src) + unit, seq, code, src, unit);
    return __shfl_sync(0xffffffffu, ok, 0) != 0;
}

// Pull dispatch: first row, in source `me`'s own region, of the rows it stages for `dst` (destinations in rank
// order; rows for itself are not staged).
__device__ __forceinline__ int64_t staged_row(const int32_t* rpm, int R, int me, int dst) {
    int64_t row = 0;
    for (int d = 0; d < dst; ++d)
        if (d != me) row += rows_from(rpm, R, me, d);
    return row;
}

// Which warps send and which receive. With num_send_blocks > 0 whole blocks take one role (blocks
// [0, num_send_blocks) send), else the first num_send_warps warps of every block send. gw/nw: this warp's index
// among the warps of its role, and their number.
struct Role {
    bool send;
    int gw, nw;
};
__device__ __forceinline__ Role assign_role(int num_send_warps, int num_send_blocks, int warp) {
    if (num_send_blocks > 0) {
        if (int(blockIdx.x) < num_send_blocks) return {true, int(blockIdx.x) * kWarps + warp, num_send_blocks * kWarps};
        return {false, (int(blockIdx.x) - num_send_blocks) * kWarps + warp,
                (int(gridDim.x) - num_send_blocks) * kWarps};
    }
    if (warp < num_send_warps) return {true, int(blockIdx.x) * num_send_warps + warp, int(gridDim.x) * num_send_warps};
    const int num_recv_warps = kWarps - num_send_warps;
    return {false, int(blockIdx.x) * num_recv_warps + warp - num_send_warps, int(gridDim.x) * num_recv_warps};
}

// ---------------------------------------------------------------------------------------------------------
// notify: barrier, count exchange (every rank receives the whole [R, R] count matrix and every rank's count of
// out-of-range expert ids), rank prefix matrix; blocks 1..R compute send_pos[:, dst] and the inverse list
// send_list[dst] by a block-wide scan.
// Expert-major mode derives all of it from top-k ids here (no separate layout step): block 0 counts tokens per
// rank, entries per expert and out-of-range ids, and also exchanges the per-expert counts to lay out every rank's
// expert-major rows (each local expert's block padded to `alignment`, blocks in expert order, inside a block the
// rows of source 0 first, then source 1, ...); blocks 1..R also write is_token_in_rank; blocks R+1..R+E give each
// (t, k) entry its position among this rank's entries for its expert.
struct NotifyArgs {
    const int32_t* num_tokens_per_rank;    // [R] (normal mode; null for a replay: barrier and send order only)
    const int32_t* num_invalid;            // [1] with num_tokens_per_rank
    const int32_t* num_tokens_per_expert;  // [E] (normal mode without top-k, else null)
    int meta[kMetaWords];                  // this rank's dispatch description (check_meta)
    bool check_meta;
    const uint8_t* in_rank;   // [N, R] (normal mode)
    const int64_t* topk_idx;  // [N, K] (expert-major mode)
    int32_t *rpm, *send_pos, *send_list, *info;
    uint8_t* in_rank_out;               // [N, R] (expert-major mode)
    int32_t *expert_pos, *send_offset;  // [N, K], [E] (expert-major mode)
    int num_tokens, num_topk, list_stride, num_experts, alignment;
    bool derive;  // expert-major mode: everything comes from topk_idx
};

__device__ __forceinline__ bool token_goes_to(const NotifyArgs& a, int t, int dst, int num_local) {
    for (int k = 0; k < a.num_topk; ++k) {
        const int64_t e = __ldg(a.topk_idx + int64_t(t) * a.num_topk + k);
        if (e >= 0 && e < a.num_experts && e / num_local == dst) return true;
    }
    return false;
}

constexpr int kPositionsPerThread = 8;
__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(DevCtx c, NotifyArgs a) {
    const int R = c.num_ranks, me = c.rank;
    const bool derive = a.derive;
    const int E = derive || a.num_tokens_per_expert != nullptr ? a.num_experts : 0, L = E / R;
    __shared__ int scratch[33];
    if (blockIdx.x == 0) {
        __shared__ int s_counts[kMaxRanks * kMaxExperts];  // this rank's [E] counts, later every rank's [R][E]
        __shared__ int s_rank[kMaxRanks], s_invalid;
        if (derive) {
            for (int i = threadIdx.x; i < E; i += blockDim.x) s_counts[i] = 0;
            if (threadIdx.x < R) s_rank[threadIdx.x] = 0;
            if (threadIdx.x == 0) s_invalid = 0;
            __syncthreads();
            for (int t = threadIdx.x; t < a.num_tokens; t += blockDim.x) {
                uint32_t ranks = 0;
                for (int k = 0; k < a.num_topk; ++k) {
                    const int64_t e = __ldg(a.topk_idx + int64_t(t) * a.num_topk + k);
                    if (e < -1 || e >= E) {
                        atomicAdd(&s_invalid, 1);
                    } else if (e >= 0) {
                        atomicAdd(&s_counts[e], 1);
                        ranks |= 1u << (int(e) / L);
                    }
                }
                for (; ranks != 0; ranks &= ranks - 1) atomicAdd(&s_rank[__ffs(int(ranks)) - 1], 1);
            }
        } else if (E > 0) {
            for (int i = threadIdx.x; i < E; i += blockDim.x) s_counts[i] = a.num_tokens_per_expert[i];
        }
        if (!block_barrier(c)) return;  // its __syncthreads also publishes the counts above to the block
        if (!derive && a.num_tokens_per_rank == nullptr) return;
        for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
            const int dst = i / R, j = i % R;
            *reinterpret_cast<volatile int*>(&header(c.bufs[dst])->counts[me][j]) =
                derive ? s_rank[j] : a.num_tokens_per_rank[j];
        }
        if (threadIdx.x < R)
            *reinterpret_cast<volatile int*>(&header(c.bufs[threadIdx.x])->invalid[me]) =
                derive ? s_invalid : *a.num_invalid;
        if (a.check_meta)
            for (int i = threadIdx.x; i < R * kMetaWords; i += blockDim.x)
                *reinterpret_cast<volatile int*>(&header(c.bufs[i / kMetaWords])->meta[me][i % kMetaWords]) =
                    a.meta[i % kMetaWords];
        for (int i = threadIdx.x; i < R * E; i += blockDim.x)
            reinterpret_cast<volatile int*>(expert_counts(c.bufs[i / E], me))[i % E] = s_counts[i % E];
        if (!block_barrier(c)) return;
        const Header* mine = header(c.bufs[me]);
        if (threadIdx.x < R) {
            const int j = threadIdx.x;
            int sum = 0;
            for (int i = 0; i < R; ++i) {
                sum += ld_volatile(&mine->counts[i][j]);
                a.rpm[i * R + j] = sum;
            }
            if (j == me) a.info[0] = sum;
        }
        if (threadIdx.x == 0) {
            int ranks = 0;  // bit i: rank i holds out-of-range expert ids
            for (int i = 0; i < R; ++i) ranks |= ld_volatile(&mine->invalid[i]) != 0 ? 1 << i : 0;
            a.info[1] = ranks;
            if (a.check_meta) {  // every rank sees every rank's words, so every rank records the same error
                // A rank that refused its call joins with its refusal code in the last word (its other words are
                // not a dispatch's): that is the error, not a mismatch.
                int refused = 0, code = 0;
                for (int i = 0; i < R; ++i) {
                    const int w = ld_volatile(&mine->meta[i][kMetaWords - 1]);
                    if (w != 0 && refused == 0) code = w;
                    refused |= w != 0 ? 1 << i : 0;
                }
                int differ = 0, words = 0;
                for (int i = 1; i < R && refused == 0; ++i)
                    for (int w = 0; w < kMetaWords; ++w)
                        if (ld_volatile(&mine->meta[i][w]) != ld_volatile(&mine->meta[0][w])) {
                            differ |= 1 << i;
                            words |= 1 << w;
                        }
                if (refused != 0) report_error(c, MOE_EP_ERR_REFUSED, refused, code);
                if (differ != 0) report_error(c, MOE_EP_ERR_MISMATCH, differ, words);
            }
        }
        if (!derive) {
            for (int l = threadIdx.x; l < L; l += blockDim.x) {  // without top-k: entries for each local expert
                int total = 0;
                for (int src = 0; src < R; ++src) total += ld_volatile(expert_counts(c.bufs[me], src) + me * L + l);
                a.info[2 + l] = total;
            }
            return;
        }
        __shared__ int s_most;  // the most expert-major rows of any rank
        if (threadIdx.x == 0) s_most = 0;
        for (int i = threadIdx.x; i < R * E; i += blockDim.x)
            s_counts[i] = ld_volatile(expert_counts(c.bufs[me], i / E) + i % E);
        __syncthreads();
        // One thread per destination rank walks its experts in order (shared-memory reads only).
        if (threadIdx.x < R) {
            const int d = threadIdx.x;
            int base = 0;
            for (int l = 0; l < L; ++l) {
                const int e = d * L + l;
                int before = 0, total = 0;
                for (int src = 0; src < R; ++src) {
                    const int n = s_counts[src * E + e];
                    before += src < me ? n : 0;
                    total += n;
                }
                a.send_offset[e] = base + before;
                const int aligned = (total + a.alignment - 1) / a.alignment * a.alignment;
                if (d == me) {
                    a.info[3 + l] = aligned;
                    a.info[3 + L + l] = total;
                }
                base += aligned;
            }
            if (d == me) a.info[2] = base;
            atomicMax(&s_most, base);
        }
        __syncthreads();
        if (threadIdx.x == 0) a.info[3 + 2 * L] = s_most;
        return;
    }
    if (int(blockIdx.x) <= R) {
        const int dst = blockIdx.x - 1;
        int running = 0;
        for (int base = 0; base < a.num_tokens; base += kNotifyThreads) {
            const int t = base + threadIdx.x;
            const bool sent =
                t < a.num_tokens && (derive ? token_goes_to(a, t, dst, L) : a.in_rank[int64_t(t) * R + dst] != 0);
            int total;
            const int pos = running + block_exclusive_sum(sent ? 1 : 0, scratch, total);
            if (t < a.num_tokens) {
                a.send_pos[int64_t(t) * R + dst] = sent ? pos : -1;
                if (sent) a.send_list[int64_t(dst) * a.list_stride + pos] = t;
                if (derive) a.in_rank_out[int64_t(t) * R + dst] = sent;
            }
            running += total;
        }
        return;
    }
    // Expert e's block: entry i's position = earlier entries with the same expert (kPositionsPerThread consecutive
    // entries per thread, a block-wide scan per tile). Deterministic, so the layout equals the reference
    // permutation's. Expert 0's block also marks the entries no expert owns.
    const int64_t e = blockIdx.x - R - 1;
    const int64_t num_entries = int64_t(a.num_tokens) * a.num_topk;
    int running = 0;
    for (int64_t base = 0; base < num_entries; base += int64_t(kNotifyThreads) * kPositionsPerThread) {
        const int64_t i0 = base + int64_t(threadIdx.x) * kPositionsPerThread;
        uint32_t match = 0;
#pragma unroll
        for (int j = 0; j < kPositionsPerThread; ++j) {
            if (i0 + j >= num_entries) continue;
            const int64_t id = __ldg(a.topk_idx + i0 + j);
            if (id == e) match |= 1u << j;
            if (e == 0 && (id < 0 || id >= E)) a.expert_pos[i0 + j] = -1;
        }
        int total;
        int pos = running + block_exclusive_sum(__popc(match), scratch, total);
        for (; match != 0; match &= match - 1) a.expert_pos[i0 + __ffs(int(match)) - 1] = pos++;
        running += total;
    }
}

__global__ void barrier_kernel(DevCtx c) {
    block_barrier(c);
}

// ---------------------------------------------------------------------------------------------------------
// dispatch. kQuant: 0 = rows travel as they are (BF16/FP32, or FP8 with its scales); 1 = BF16 rows and
// 2 = FP32 rows quantized to FP8 in the send path. The other data-path modes are template parameters too:
// kFp8Out (received rows are FP8 + scales: FP8 input rows when kQuant is 0, else not dequantized), kTopk (what
// travels with the rows: nothing, local top-k ids, expert-major rows) and kPull (pull dispatch allowed): 0/1 (kTopk:
// a DispatchTopk), one kernel per combination (csrc/api.cu's SWITCH_* launch cases), so that each compiles the other
// modes' code out and gets only the registers its own mode needs.
enum DispatchTopk : int { kNoTopk = 0, kLocalTopk = 1, kExpertTopk = 2 };
// A dispatch's modes as its parameters give them: the launch picks the specialisation from these.
inline int dispatch_topk(const moe_ep_dispatch_params& p) {
    if (p.expert_major != 0) return kExpertTopk;
    return (p.topk_idx != nullptr || p.recv_topk_idx != nullptr) && p.num_topk > 0 ? kLocalTopk : kNoTopk;
}
inline bool dispatch_fp8_out(const moe_ep_dispatch_params& p, bool quantize) {
    return (quantize ? p.fp8_out : p.fp8_in) != 0;
}

template <int kQuant>
struct InputType {
    using type = uint8_t;
};
template <>
struct InputType<1> {
    using type = __nv_bfloat16;
};
template <>
struct InputType<2> {
    using type = float;
};

// Token t's k-th expert as seen by rank `owner`: local id (-1 when the expert lives elsewhere) and weight (0
// there), as the torch transport computes them.
__device__ __forceinline__ void localize(const moe_ep_dispatch_params& p, int t, int owner, int k, int& idx,
                                         float& weight) {
    const int L = int(p.num_local_experts);
    const int64_t e = __ldg(p.topk_idx + int64_t(t) * p.num_topk + k);
    const int64_t lo = int64_t(owner) * L;
    idx = (e >= lo && e < lo + L) ? int(e - lo) : -1;
    weight = (p.topk_weights != nullptr && idx >= 0) ? __ldg(p.topk_weights + int64_t(t) * p.num_topk + k) : 0.0f;
}

// Expert-major mode: the row token t's k-th entry takes in `owner`'s expert-major layout (-1 when the expert
// lives elsewhere or the entry is -1) and its weight (0 there).
__device__ __forceinline__ void expert_entry(const moe_ep_dispatch_params& p, int t, int owner, int k, int& row,
                                             float& weight) {
    const int64_t i = int64_t(t) * p.num_topk + k;
    const int64_t e = __ldg(p.topk_idx + i);
    const bool here = e >= 0 && e / p.num_local_experts == owner;
    row = here ? __ldg(p.send_offset + e) + __ldg(p.expert_pos + i) : -1;
    weight = (p.topk_weights != nullptr && here) ? __ldg(p.topk_weights + i) : 0.0f;
}

__device__ __forceinline__ void emit_entry(const moe_ep_dispatch_params& p, int64_t row, int k, int idx, float weight,
                                           int* s_hist) {
    p.recv_topk_idx[row * p.num_topk + k] = idx;
    if (p.recv_topk_weights != nullptr) p.recv_topk_weights[row * p.num_topk + k] = weight;
    if (idx >= 0 && p.recv_expert_count != nullptr) atomicAdd(&s_hist[idx], 1);
}

__device__ __forceinline__ void record_slot(const moe_ep_dispatch_params& p, int64_t recv_row, int k, int row,
                                            float weight) {
    p.recv_slot[recv_row * p.num_topk + k] = row;
    if (row >= 0 && p.expert_probs != nullptr) p.expert_probs[row] = weight;
}

// Calls f(i, k, t_i) for every (row, top-k entry) of a chunk of `rows` rows, spread over the lanes so all their
// loads are in flight together; `tok` holds the token of row i in lane i.
template <typename F>
__device__ __forceinline__ void for_each_entry(int rows, int K, int tok, int lane, F&& f) {
    for (int e0 = 0; e0 < rows * K; e0 += 32) {
        const int e = e0 + lane;
        const int i = min(e / K, rows - 1);
        const int t = __shfl_sync(0xffffffffu, tok, i);
        if (e < rows * K) f(i, e - i * K, t);
    }
}

template <int kQuant, int kFp8Out, int kTopk, int kPull>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(DevCtx c, moe_ep_dispatch_params p, SlotLayout sl, int hist_bytes) {
    using T = typename InputType<kQuant>::type;
    using OutT = typename std::conditional<kQuant == 2, float, __nv_bfloat16>::type;  // dequantized rows
    extern __shared__ __align__(16) char smem[];
    int* s_hist = reinterpret_cast<int*>(smem);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int4* stage = reinterpret_cast<int4*>(smem + hist_bytes) + warp * kStageVecs;  // this warp's (copy_row)
    const int R = c.num_ranks, me = c.rank;
    const int H = int(p.hidden), K = int(p.num_topk), L = int(p.num_local_experts);
    const int S = sl.num_scales;
    const int32_t* rpm = p.rank_prefix_matrix;
    // Each mode a compile-time constant, so the code of the others folds away.
    const bool expert = kTopk == kExpertTopk;                                   // top-k travels as expert-major rows
    const bool send_topk = kTopk != kNoTopk && p.topk_idx != nullptr && K > 0;  // this rank's rows carry top-k
    const bool recv_topk = kTopk == kLocalTopk && p.recv_topk_idx != nullptr && K > 0;  // received: local top-k
    const bool fp8_out = kFp8Out != 0;
    const bool fp8_in = kQuant == 0 && fp8_out;
    const bool wire_fp8 = kQuant != 0 || fp8_out;
    const bool dequant = kQuant != 0 && !fp8_out;  // FP8 input rows arrive as they are
    const bool pull = kPull != 0;
    const int64_t in_row_bytes = int64_t(H) * p.x_elem_bytes;
    const int64_t out_row_bytes = dequant ? int64_t(H) * int64_t(sizeof(OutT)) : int64_t(sl.payload_bytes);
    const char* x = static_cast<const char*>(p.x);
    char* recv_x = static_cast<char*>(p.recv_x);
    // After an error (e.g. the notify barrier timed out) the layout in memory is not trustworthy: do nothing.
    if (ld_volatile(&header(c.bufs[me])->abort) != 0) return;
    for (int i = threadIdx.x; i < L && recv_topk; i += blockDim.x) s_hist[i] = 0;
    __syncthreads();

    const int seq = ld_volatile(&header(c.bufs[me])->barrier_count);
    const int total_recv = rpm[(R - 1) * R + me];
    const bool fits = total_recv <= p.num_recv_rows;
    if (!fits && p.speculative_rows == 0 && blockIdx.x == 0 && threadIdx.x == 0)
        report_error(c, MOE_EP_ERR_WORST_TOKENS, total_recv, int(p.num_recv_rows));
    const int cap_rows = int(min(c.region_bytes / sl.slot_bytes, int64_t(kMaxRegionRows)));
    const Role role = assign_role(int(p.num_send_warps), 0, warp);
    // Pulling: source s stages its rows in its own region of its own buffer when all of them fit there (every rank
    // computes this alike from the rank prefix matrix), and receivers load them over NVLink.
    auto pulls = [&](int s) { return pull && staged_row(rpm, R, s, R) * sl.slot_bytes <= c.region_bytes; };

    // Row t of x, read (and quantized) once: to the peer's staging slot `wire` and to the destination of `out`
    // (OneRow; each skipped when null). A plain copy goes through registers; FP8 rows come from
    // the quantizer, dequantized again for outputs that want BF16/FP32.
    auto write_to = [&](int t, char* wire, const auto& out) {
        if (wire == nullptr && !out.any()) return;
        const char* src = x + int64_t(t) * in_row_bytes;
        if constexpr (kQuant == 0) {  // FP8 input rows and their scales arrive as they are
            const float* xs = fp8_in ? p.x_scales + int64_t(t) * S : nullptr;
            if (fp8_in && S % 4 == 0 && (reinterpret_cast<uintptr_t>(p.x_scales) & 15) == 0) {
                // the scales (16-byte rows) in the same batch of loads as the payload
                copy_row(stage, reinterpret_cast<int4*>(wire), out, reinterpret_cast<const int4*>(src),
                         (sl.payload_bytes + 4 * S) / 16, lane, sl.payload_bytes / 16,
                         reinterpret_cast<const int4*>(xs));
            } else {
                copy_row(stage, reinterpret_cast<int4*>(wire), out, reinterpret_cast<const int4*>(src),
                         sl.payload_bytes / 16, lane);
                if (!fp8_in) return;
                copy_floats<false>(wire ? reinterpret_cast<float*>(wire + sl.scales_off) : nullptr, out.scales(), xs, S,
                                   lane);
            }
        } else {
            const bool out_q = out.head != nullptr && !dequant;
            quantize_row<T>(reinterpret_cast<const T*>(src), H, reinterpret_cast<uint8_t*>(wire),
                            wire ? reinterpret_cast<float*>(wire + sl.scales_off) : nullptr,
                            out_q ? reinterpret_cast<uint8_t*>(out.head) : nullptr,
                            out_q ? reinterpret_cast<float*>(out.tail) : nullptr,
                            out.head != nullptr && dequant ? reinterpret_cast<T*>(out.head) : nullptr,
                            p.round_scale != 0, lane);
        }
    };
    // This rank's output of received row r (-1: none): row r of recv_x.
    auto write_row = [&](int t, char* wire, int64_t r) {
        write_to(t, wire,
                 OneRow{r < 0 ? nullptr : recv_x + r * out_row_bytes,
                        r < 0 ? nullptr : reinterpret_cast<char*>(p.recv_scales + r * S)});
    };
    // A token kept here and sent to peers is read (and quantized) once, by the sender of its first peer in the
    // order me+1, me+2, ...: that sender also writes this rank's own output row; the receivers write the rest.
    // (Receivers writing every own row instead read such tokens twice, and measured slower.)
    const int64_t self_base = offset_from(rpm, R, me, me);
    auto first_peer = [&](int t) {
        for (int k = 1; k < R; ++k)
            if (__ldg(p.send_pos + int64_t(t) * R + (me + k) % R) >= 0) return (me + k) % R;
        return -1;
    };

    if (role.send) {
        // ---- send: chunks of rows to every peer, interleaved over peers ----
        const int gw = role.gw, nw = role.nw;
        int max_chunks = 0;
        for (int d = 0; d < R; ++d)
            if (d != me) max_chunks = max(max_chunks, (rows_from(rpm, R, me, d) + kChunkRows - 1) / kChunkRows);
        for (int u = gw; R > 1 && u < max_chunks * (R - 1); u += nw) {
            const int chunk = u / (R - 1), d = (me + 1 + u % (R - 1)) % R;
            const int count = rows_from(rpm, R, me, d);
            const int begin = chunk * kChunkRows, rows = min(kChunkRows, count - begin);
            if (rows <= 0) continue;
            if (begin + rows > cap_rows) {
                if (lane == 0) report_error(c, MOE_EP_ERR_CAPACITY, count, cap_rows);
                break;
            }
            char* first = pulls(me) ? region(c, me, me) + (staged_row(rpm, R, me, d) + begin) * sl.slot_bytes
                                    : region(c, d, me) + int64_t(begin) * sl.slot_bytes;
            const int tok = lane < rows ? __ldg(p.send_list + int64_t(d) * p.list_stride + begin + lane) : -1;
            prefetch_rows(x, in_row_bytes, tok, __ballot_sync(0xffffffffu, lane < rows), lane);
            if (send_topk)
                for_each_entry(rows, K, tok, lane, [&](int i, int k, int t) {
                    int idx;
                    float weight;
                    if (expert) {
                        expert_entry(p, t, d, k, idx, weight);
                    } else {
                        localize(p, t, d, k, idx, weight);
                    }
                    char* slot = first + int64_t(i) * sl.slot_bytes;
                    reinterpret_cast<int*>(slot + sl.idx_off)[k] = idx;
                    reinterpret_cast<float*>(slot + sl.w_off)[k] = weight;
                });
            if (lane < rows) *reinterpret_cast<int*>(first + int64_t(lane) * sl.slot_bytes + sl.src_off) = tok;
            // Where each row also lands here (-1: nowhere), lane i for row i, so the rows' lookups overlap.
            int64_t own_row = -1;
            if (lane < rows && fits) {
                const int pos = __ldg(p.send_pos + int64_t(tok) * R + me);
                if (pos >= 0 && first_peer(tok) == d) own_row = self_base + pos;
            }
            for (int i = 0; i < rows; ++i)
                write_row(__shfl_sync(0xffffffffu, tok, i), first + int64_t(i) * sl.slot_bytes,
                          __shfl_sync(0xffffffffu, own_row, i));
            publish(flags(c.bufs[d], me) + chunk, seq, lane);
        }
    } else {
        // ---- receive: own rows straight from x, peers' rows from the staging regions once published ----
        const int gw = role.gw, nw = role.nw;
        // own rows first (nothing to wait for), then the peers' chunks interleaved over sources
        const int self_chunks = (rows_from(rpm, R, me, me) + kChunkRows - 1) / kChunkRows;
        int max_chunks = 0;
        for (int s = 0; s < R; ++s)
            if (s != me) max_chunks = max(max_chunks, (rows_from(rpm, R, s, me) + kChunkRows - 1) / kChunkRows);
        const int num_units = self_chunks + (R - 1) * max_chunks;
        int seen[kMaxRanks];
        for (int r = 0; r < kMaxRanks; ++r) seen[r] = kNotSeen;
        for (int u = gw; fits && u < num_units; u += nw) {
            const int v = u - self_chunks;
            const int chunk = v < 0 ? u : v / (R - 1);
            const int s = v < 0 ? me : (me + 1 + v % (R - 1)) % R;
            const int count = rows_from(rpm, R, s, me);
            const int begin = chunk * kChunkRows, rows = min(kChunkRows, count - begin);
            if (rows <= 0) continue;
            const int64_t out_first = offset_from(rpm, R, s, me) + begin;
            if (s == me) {
                const int tok = lane < rows ? __ldg(p.send_list + int64_t(me) * p.list_stride + begin + lane) : -1;
                const uint32_t own_rows = __ballot_sync(0xffffffffu, lane < rows && first_peer(tok) < 0);
                prefetch_rows(x, in_row_bytes, tok, own_rows, lane);
                if (send_topk)
                    for_each_entry(rows, K, tok, lane, [&](int i, int k, int t) {
                        int idx;
                        float weight;
                        if (expert) {
                            expert_entry(p, t, me, k, idx, weight);
                            record_slot(p, out_first + i, k, idx, weight);
                        } else if (recv_topk) {
                            localize(p, t, me, k, idx, weight);
                            emit_entry(p, out_first + i, k, idx, weight, s_hist);
                        }
                    });
                if (lane < rows) p.recv_src_idx[out_first + lane] = tok;
                for (int i = 0; i < rows; ++i)
                    write_row(__shfl_sync(0xffffffffu, tok, i), nullptr, (own_rows >> i) & 1u ? out_first + i : -1);
                continue;
            }
            if (!wait_rows(c, s, begin, Arrival{0, 1} /* every row by SM stores */, seq, MOE_EP_ERR_DISPATCH_TIMEOUT,
                           seen[s], lane))
                break;
            const char* first = pulls(s) ? region(c, s, s) + (staged_row(rpm, R, s, me) + begin) * sl.slot_bytes
                                         : region(c, me, s) + int64_t(begin) * sl.slot_bytes;
            if (recv_topk || expert)
                for_each_entry(rows, K, 0, lane, [&](int i, int k, int) {
                    const char* slot = first + int64_t(i) * sl.slot_bytes;
                    const int idx = reinterpret_cast<const volatile int*>(slot + sl.idx_off)[k];
                    const float weight = reinterpret_cast<const volatile float*>(slot + sl.w_off)[k];
                    if (expert) {
                        record_slot(p, out_first + i, k, idx, weight);
                    } else {
                        emit_entry(p, out_first + i, k, idx, weight, s_hist);
                    }
                });
            if (lane < rows)
                p.recv_src_idx[out_first + lane] =
                    *reinterpret_cast<const volatile int*>(first + int64_t(lane) * sl.slot_bytes + sl.src_off);
            // The staged row `slot` into this rank's output `out` (OneRow).
            auto receive_row = [&](const char* slot, const auto& out) {
                if (dequant) {
                    dequant_row<true, OutT>(stage, reinterpret_cast<const uint8_t*>(slot),
                                            reinterpret_cast<const float*>(slot + sl.scales_off), out, H, lane);
                    return;
                }
                if (wire_fp8 && S % 4 == 0) {  // the scales in the payload's batch of loads (as above)
                    copy_row(stage, nullptr, out, reinterpret_cast<const int4*>(slot), (sl.payload_bytes + 4 * S) / 16,
                             lane, sl.payload_bytes / 16);
                    return;
                }
                copy_row(stage, nullptr, out, reinterpret_cast<const int4*>(slot), sl.payload_bytes / 16, lane);
                if (wire_fp8)
                    copy_floats<true>(nullptr, out.scales(), reinterpret_cast<const float*>(slot + sl.scales_off), S,
                                      lane);
            };
            for (int i = 0; i < rows; ++i) {
                const char* slot = first + int64_t(i) * sl.slot_bytes;
                receive_row(slot,
                            OneRow{recv_x + (out_first + i) * out_row_bytes,
                                   wire_fp8 ? reinterpret_cast<char*>(p.recv_scales + (out_first + i) * S) : nullptr});
            }
        }
    }
    __syncthreads();
    if (recv_topk && p.recv_expert_count != nullptr)
        for (int i = threadIdx.x; i < L; i += blockDim.x)
            if (s_hist[i]) atomicAdd(&p.recv_expert_count[i], s_hist[i]);
    if (!fits) return;
    const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, nthreads = int64_t(gridDim.x) * blockDim.x;
    if (expert) {
        // Padding rows at the end of each local expert's block get probability 0 (permute zeroes their rows).
        if (p.alignment <= 1 || p.expert_probs == nullptr) return;
        int64_t base = 0;
        for (int l = 0; l < L; ++l) {
            const int aligned = p.expert_info[3 + l], exact = p.expert_info[3 + L + l];
            for (int64_t i = tid; i < aligned - exact; i += nthreads) p.expert_probs[base + exact + i] = 0.0f;
            base += aligned;
        }
        return;
    }
    // num_worst_tokens: rows past the received ones hold zeros, top-k ids -1, weights 0, source index -1.
    const int64_t tail_rows = p.num_recv_rows - total_recv;
    if (tail_rows <= 0 || p.speculative_rows != 0) return;  // a guess's spare rows are sliced off, not filled
    int4* tail_x = reinterpret_cast<int4*>(recv_x + total_recv * out_row_bytes);
    for (int64_t i = tid; i < tail_rows * out_row_bytes / 16; i += nthreads) tail_x[i] = make_int4(0, 0, 0, 0);
    if (wire_fp8 && !dequant)
        for (int64_t i = tid; i < tail_rows * S; i += nthreads) p.recv_scales[total_recv * S + i] = 0.0f;
    if (p.recv_topk_idx != nullptr)
        for (int64_t i = tid; i < tail_rows * K; i += nthreads) {
            p.recv_topk_idx[total_recv * K + i] = -1;
            if (p.recv_topk_weights != nullptr) p.recv_topk_weights[total_recv * K + i] = 0.0f;
        }
    for (int64_t i = tid; i < tail_rows; i += nthreads) p.recv_src_idx[total_recv + i] = -1;
}

// ---------------------------------------------------------------------------------------------------------
// combine: every rank pushes the rows it received back into the origin's region for it (same positions as
// the dispatch send order; there, `count` rows of row_bytes and then their weights, [count, K] fp32), by sender
// warps or (copy_engine) all of them by the host-side copy streams, straight from x; the origin sums each token's
// copies in fp32 from its biases, in summing_order's order (DeepEP V2's).
// kRanks: the rank count rounded up to a power of two, so each lane issues the loads of every contribution
// for kCopyBatch / kRanks vectors before adding any of them.
// A token's copies in the order combine sums them (moe_ep.h, moe_ep_combine_params.topk_idx): ord[i] is the
// i-th copy (nullptr: none). Every lane of the warp gets the same order.
template <int kRanks>
__device__ __forceinline__ void summing_order(const moe_ep_combine_params& p, int t, int lane, int R,
                                              const char* const (&src)[kRanks], const char* (&ord)[kRanks]) {
    int owner = -1;
    if (p.topk_idx != nullptr && lane < p.idx_topk) {
        const int64_t e = __ldg(p.topk_idx + int64_t(t) * p.idx_topk + lane);
        if (e >= 0 && e < p.num_local_experts * R) owner = int(e / p.num_local_experts);
    }
    int last[kRanks];  // the last slot naming rank r, -1 for none
#pragma unroll
    for (int r = 0; r < kRanks; ++r) last[r] = __reduce_max_sync(0xffffffffu, owner == r ? lane : -1);
#pragma unroll
    for (int i = 0; i < kRanks; ++i) ord[i] = nullptr;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
        int pos = 0;
#pragma unroll
        for (int q = 0; q < kRanks; ++q) pos += (last[q] < last[r] || (last[q] == last[r] && q < r)) ? 1 : 0;
#pragma unroll
        for (int i = 0; i < kRanks; ++i)
            if (pos == i) ord[i] = src[r];
    }
}

template <typename T, int kRanks>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(DevCtx c, moe_ep_combine_params p) {
    constexpr int kN = Vec<T>::kN;
    constexpr int kUnroll = kCopyBatch / kRanks;
    extern __shared__ __align__(16) char smem[];
    const int R = c.num_ranks, me = c.rank;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int4* stage = reinterpret_cast<int4*>(smem) + warp * kStageVecs;  // this warp's (copy_row, the sums' loads)
    const int K = int(p.num_topk);
    const int64_t row_bytes = p.hidden * int64_t(sizeof(T));
    const int n16 = int(row_bytes / 16);
    const int32_t* rpm = p.rank_prefix_matrix;
    const char* x = static_cast<const char*>(p.x);
    if (ld_volatile(&header(c.bufs[me])->abort) != 0) return;
    const int seq = ld_volatile(&header(c.bufs[me])->barrier_count);
    const bool ce = p.copy_engine != 0;
    const int cap_rows = int(min(c.region_bytes / (row_bytes + 4 * K), int64_t(kMaxRegionRows)));
    const Role role = assign_role(int(p.num_send_warps), int(p.num_send_blocks), warp);

    if (role.send) {
        // the rows chunk by chunk, interleaved over peers (none when the copy engines carry them)
        const int gw = role.gw, nw = role.nw;
        int max_chunks = 0;
        for (int d = 0; d < R; ++d) {
            const int count = rows_from(rpm, R, d, me);
            if (d != me) max_chunks = max(max_chunks, (count - copied_rows(count, ce) + kChunkRows - 1) / kChunkRows);
        }
        for (int u = gw; R > 1 && u < max_chunks * (R - 1); u += nw) {
            const int d = (me + 1 + u % (R - 1)) % R;
            const int count = rows_from(rpm, R, d, me);
            const int begin = copied_rows(count, ce) + u / (R - 1) * kChunkRows, end = min(begin + kChunkRows, count);
            if (begin >= count) continue;
            if (count > cap_rows) {
                if (lane == 0) report_error(c, MOE_EP_ERR_CAPACITY, count, cap_rows);
                break;
            }
            const int64_t base = offset_from(rpm, R, d, me);
            char* dst_region = region(c, d, me);
            prefetch_rows(x, row_bytes, int(base) + begin + lane, __ballot_sync(0xffffffffu, lane < end - begin), lane);
            for (int i = 0; i < end - begin; ++i)
                copy_row(stage, reinterpret_cast<int4*>(dst_region + int64_t(begin + i) * row_bytes),
                         OneRow{nullptr, nullptr}, reinterpret_cast<const int4*>(x + (base + begin + i) * row_bytes),
                         n16, lane);
            if (p.topk_weights != nullptr) {
                float* w = reinterpret_cast<float*>(dst_region + count * row_bytes) + int64_t(begin) * K;
                for (int e = lane; e < (end - begin) * K; e += 32)
                    w[e] = __ldg(p.topk_weights + (base + begin) * K + e);
            }
            publish(flags(c.bufs[d], me) + begin / kChunkRows, seq, lane);
        }
        return;
    }
    const int gw = role.gw, nw = role.nw;
    const int64_t self_base = offset_from(rpm, R, me, me);
    // How rank r's copies of this rank's tokens arrive, and where they and their weights start: pushed into
    // r's region here (rows, then their weights), or, pulling, in r's own region of r's buffer (r's x in r's
    // receive order, where the rows this rank sent r start at offset_from(rpm, me, r); weights at a fixed offset).
    const bool pull = p.pull != 0;
    int seen[kRanks];
    Arrival arrival[kRanks];
    const char* row_base[kRanks];
    const float* w_base[kRanks];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
        const int count = r < R ? rows_from(rpm, R, me, r) : 0;
        seen[r] = kNotSeen;
        arrival[r] = arrival_of(count, ce, int(p.copy_piece_rows));
        if (r >= R || r == me) {
            row_base[r] = nullptr;
            w_base[r] = nullptr;
        } else if (pull) {
            const int64_t first = offset_from(rpm, R, me, r);
            row_base[r] = region(c, r, r) + first * row_bytes;
            w_base[r] = reinterpret_cast<const float*>(region(c, r, r) + pull_weights_offset(c, K)) + first * K;
        } else {
            row_base[r] = region(c, me, r);
            w_base[r] = reinterpret_cast<const float*>(region(c, me, r) + count * row_bytes);
        }
    }
    const char* bias0 = static_cast<const char*>(p.bias0);
    const char* bias1 = static_cast<const char*>(p.bias1);
    // send_pos of the next token is loaded while the current one is summed, lane r holding rank r's (one register
    // per lane, not one per rank: rank arrays of that size made the kernel spill)
    int next_pos = (lane < R && gw < p.num_tokens) ? __ldg(p.send_pos + int64_t(gw) * R + lane) : -1;
    for (int t = gw; t < p.num_tokens; t += nw) {
        const int lane_pos = next_pos;
        next_pos = (lane < R && t + nw < p.num_tokens) ? __ldg(p.send_pos + int64_t(t + nw) * R + lane) : -1;
        const char* src[kRanks];
        bool ok = true;
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
            src[r] = nullptr;
            const int pos = __shfl_sync(0xffffffffu, lane_pos, r);
            if (pos < 0) continue;
            if (r == me) {
                src[r] = x + (self_base + pos) * row_bytes;
                continue;
            }
            if (!pull && !wait_rows(c, r, pos, arrival[r], seq, MOE_EP_ERR_COMBINE_TIMEOUT, seen[r], lane)) ok = false;
            src[r] = row_base[r] + int64_t(pos) * row_bytes;
        }
        if (!ok) break;
        const char* ord[kRanks];
        summing_order<kRanks>(p, t, lane, R, src, ord);
        int4* out = reinterpret_cast<int4*>(static_cast<char*>(p.out) + int64_t(t) * row_bytes);
#pragma unroll 1
        for (int j0 = lane; j0 < n16; j0 += 32 * kUnroll) {
            // contribution i's vector u in slot i * kUnroll + u of the warp's stage
#pragma unroll
            for (int i = 0; i < kRanks; ++i)
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int j = j0 + 32 * u;
                    if (ord[i] != nullptr && j < n16)
                        cp_async16(stage + 32 * (i * kUnroll + u) + lane, reinterpret_cast<const int4*>(ord[i]) + j);
                }
            cp_async_wait_all();
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int j = j0 + 32 * u;
                if (j >= n16) continue;
                float acc[kN];
#pragma unroll
                for (int i = 0; i < kN; ++i) acc[i] = 0.0f;
                if (bias0 != nullptr)
                    Vec<T>::add(acc, __ldg(reinterpret_cast<const int4*>(bias0 + int64_t(t) * row_bytes) + j));
                if (bias1 != nullptr)
                    Vec<T>::add(acc, __ldg(reinterpret_cast<const int4*>(bias1 + int64_t(t) * row_bytes) + j));
#pragma unroll
                for (int i = 0; i < kRanks; ++i)
                    if (ord[i] != nullptr) Vec<T>::add(acc, stage[32 * (i * kUnroll + u) + lane]);
                out[j] = Vec<T>::pack(acc);
            }
        }
        if (p.out_weights != nullptr) {
            float w = 0.0f;
#pragma unroll
            for (int r = 0; r < kRanks; ++r) {
                const int pos = __shfl_sync(0xffffffffu, lane_pos, r);
                if (pos < 0 || lane >= K) continue;
                if (r == me) {
                    w += __ldg(p.topk_weights + (self_base + pos) * K + lane);
                } else {
                    w += reinterpret_cast<const volatile float*>(w_base[r])[int64_t(pos) * K + lane];
                }
            }
            if (lane < K) p.out_weights[int64_t(t) * K + lane] = w;
        }
    }
}

}  // namespace moe_ep
