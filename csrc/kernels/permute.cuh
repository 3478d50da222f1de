#pragma once
// Device code of the local expert-major permutation (csrc/moe_ep.h; launched from csrc/api.cu): slot assignment,
// the row scatter into expert blocks and the fixed-order gather-sums back. The transports compose their expert-major
// dispatch and combine with these.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cuda_bf16.h>
#include <string>

#include "../common.cuh"
#include "../moe_ep.h"

namespace moe_ep {
namespace permute_kernels {

constexpr int kWarpsPerBlock = 8;
constexpr int kBlockThreads = kWarpsPerBlock * 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxDevices = 64;
constexpr int kPermuteUnroll = 4;                // 16-byte vectors of a row each lane holds before storing them K times
constexpr int kChunkVecs = 32 * kPermuteUnroll;  // 16-byte vectors of a row per work item (one warp)
constexpr int kUnpermuteBatch = 8;               // slot rows whose vectors are loaded together, then summed in order
constexpr int kSlotsBatch = 4;                   // expert_slots: 32-entry steps whose ids a warp loads together
constexpr int kCountsBatch = 8;                  // expert_slots: block counts each thread loads together

__device__ __forceinline__ unsigned lanemask_lt() {
    unsigned mask;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
    return mask;
}

// ---------------------------------------------------------------------------------------------------------------
// expert_slots: two kernels over the same grid, each warp on a contiguous range of the flat [N * K] entries
// (row-major = the contract's order). Counts: every warp counts the pairs per local expert in its range; blocks
// publish their totals. Place: every block counts its warps again, derives the same aligned totals and bases from all
// blocks' counts (integer sums: exact and deterministic; shared-memory atomics only add counts) and the first row of
// each expert for each of its warps, then the warps walk their range again and hand out rows in order. Ranks inside
// a 32-entry step come from __match_any_sync, never from atomics. No grid-wide sync: the kernel boundary orders them.

// Local expert of flat entry i of a warp range ending at `end`, or -1 (past the end, -1, or not local).
__device__ __forceinline__ int local_expert(const int64_t* topk_idx, int64_t i, int64_t end, int num_local_experts) {
    if (i >= end) return -1;
    const int64_t e = __ldg(topk_idx + i);
    return (e >= 0 && e < num_local_experts) ? int(e) : -1;
}

// The words a one-rank dispatch reads on the host, summed per block: rows naming a local expert (counted by the
// lane holding the row's first column, so once per row) and ids outside [-1, L).
struct SlotExtras {
    int rows, invalid;
};
__device__ __forceinline__ SlotExtras warp_extras(const int64_t* topk_idx, int64_t begin, int64_t end, int num_topk,
                                                  int L) {
    SlotExtras mine{0, 0};
    for (int64_t i = begin + (threadIdx.x & 31); i < end; i += 32) {
        const int64_t e = __ldg(topk_idx + i);
        mine.invalid += (e < -1 || e >= L);
        if (i % num_topk == 0) {
            bool named = false;
            for (int k = 0; k < num_topk; ++k) {
                const int64_t c = __ldg(topk_idx + i + k);
                named |= (c >= 0 && c < L);
            }
            mine.rows += named;
        }
    }
    return {__reduce_add_sync(kFullMask, mine.rows), __reduce_add_sync(kFullMask, mine.invalid)};
}

// Walks the warp's entries [begin, end) in order, 32 at a time (ids of kSlotsBatch steps loaded together), calling
// step(i, e, peers) with the lane's entry i, its local expert e (-1: none) and the lanes sharing e.
template <typename Step>
__device__ __forceinline__ void walk_entries(const int64_t* topk_idx, int64_t begin, int64_t end, int num_local_experts,
                                             Step step) {
    const int lane = threadIdx.x & 31;
    for (int64_t i = begin; i < end; i += 32 * kSlotsBatch) {
        int e[kSlotsBatch];
#pragma unroll
        for (int u = 0; u < kSlotsBatch; ++u) e[u] = local_expert(topk_idx, i + 32 * u + lane, end, num_local_experts);
#pragma unroll
        for (int u = 0; u < kSlotsBatch; ++u) {
            if (i + 32 * u >= end) break;  // warp-uniform
            step(i + 32 * u + lane, e[u], __match_any_sync(kFullMask, e[u]));
        }
    }
}

// In-place exclusive prefix sum of s[0, n) by the whole block (consecutive elements per thread, then
// block_exclusive_sum over the threads); scratch holds 33 ints.
__device__ void block_exclusive_scan(int* s, int n, int* scratch) {
    const int per_thread = (n + kBlockThreads - 1) / kBlockThreads;
    const int first = threadIdx.x * per_thread;
    int local = 0;
    for (int q = 0; q < per_thread; ++q)
        if (first + q < n) local += s[first + q];
    int total;
    int running = block_exclusive_sum(local, scratch, total);
    for (int q = 0; q < per_thread; ++q) {
        if (first + q < n) {
            const int c = s[first + q];
            s[first + q] = running;
            running += c;
        }
    }
    __syncthreads();
}

// The warp's range of entries and its pairs per local expert in `mine` (the warp's row of `counters` [warp][L]).
struct WarpRange {
    int64_t begin, end;
};
__device__ __forceinline__ WarpRange count_warp_range(const int64_t* topk_idx, int64_t num_entries, int L,
                                                      int64_t per_warp, int* counters) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t begin = min((int64_t(blockIdx.x) * kWarpsPerBlock + warp) * per_warp, num_entries);
    const int64_t end = min(begin + per_warp, num_entries);
    int* mine = counters + warp * L;
    for (int i = threadIdx.x; i < kWarpsPerBlock * L; i += kBlockThreads) counters[i] = 0;
    __syncthreads();
    // Lanes naming the same expert elect their lowest lane, which adds the group's size: one writer per address.
    walk_entries(topk_idx, begin, end, L, [&](int64_t, int e, unsigned peers) {
        if (e >= 0 && lane == __ffs(peers) - 1) mine[e] += __popc(peers);
        __syncwarp();
    });
    __syncthreads();
    return {begin, end};
}

// block_counts: [blocks][L] pairs per local expert, then [blocks][2] the block's SlotExtras.
__global__ void __launch_bounds__(kBlockThreads)
    slot_counts_kernel(const int64_t* __restrict__ topk_idx, int64_t num_entries, int num_topk, int num_local_experts,
                       int64_t per_warp, int32_t* __restrict__ block_counts) {
    extern __shared__ int smem[];
    __shared__ int extras[2];
    const int L = num_local_experts;
    if (threadIdx.x < 2) extras[threadIdx.x] = 0;  // ordered before the adds by count_warp_range's barriers
    const WarpRange range = count_warp_range(topk_idx, num_entries, L, per_warp, smem);
    for (int l = threadIdx.x; l < L; l += kBlockThreads) {
        int sum = 0;
        for (int w = 0; w < kWarpsPerBlock; ++w) sum += smem[w * L + l];
        block_counts[int64_t(blockIdx.x) * L + l] = sum;
    }
    const SlotExtras warp = warp_extras(topk_idx, range.begin, range.end, num_topk, L);
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(&extras[0], warp.rows);
        atomicAdd(&extras[1], warp.invalid);
    }
    __syncthreads();
    if (threadIdx.x < 2) block_counts[int64_t(gridDim.x) * L + 2 * blockIdx.x + threadIdx.x] = extras[threadIdx.x];
}

__global__ void __launch_bounds__(kBlockThreads)
    slot_place_kernel(const int64_t* __restrict__ topk_idx, int64_t num_entries, int num_local_experts, int alignment,
                      int64_t per_warp, int32_t* __restrict__ recv_slot, const int32_t* __restrict__ block_counts,
                      int64_t* __restrict__ words) {
    extern __shared__ int smem[];
    const int L = num_local_experts;
    int* counters = smem;                         // [warp][l]: the warp's pairs of l, then its next row of l
    int* totals = counters + kWarpsPerBlock * L;  // [l]: aligned totals, then their exclusive prefix (bases)
    int* before = totals + L;                     // [l]: pairs of l in the blocks before this one
    int* scratch = before + L;                    // [33]: the block scan's scratch
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const WarpRange range = count_warp_range(topk_idx, num_entries, L, per_warp, counters);
    for (int l = threadIdx.x; l < L; l += kBlockThreads) totals[l] = before[l] = 0;
    __syncthreads();

    // All threads sweep the [blocks][L] counts, kCountsBatch loads in flight each.
    const int num_counts = int(gridDim.x) * L, earlier = int(blockIdx.x) * L;
    for (int first = threadIdx.x; first < num_counts; first += kBlockThreads * kCountsBatch) {
        int c[kCountsBatch];
#pragma unroll
        for (int u = 0; u < kCountsBatch; ++u) {
            const int i = first + u * kBlockThreads;
            c[u] = i < num_counts ? __ldg(block_counts + i) : 0;
        }
#pragma unroll
        for (int u = 0; u < kCountsBatch; ++u) {
            const int i = first + u * kBlockThreads;
            if (c[u] == 0) continue;
            atomicAdd(&totals[i % L], c[u]);
            if (i < earlier) atomicAdd(&before[i % L], c[u]);
        }
    }
    __syncthreads();
    for (int l = threadIdx.x; l < L; l += kBlockThreads)
        totals[l] = int((int64_t(totals[l]) + alignment - 1) / alignment * alignment);
    __syncthreads();
    if (words != nullptr && blockIdx.x == 0) {  // [rows, invalid, aligned totals [L]]: what the host reads
        for (int l = threadIdx.x; l < L; l += kBlockThreads) words[2 + l] = totals[l];
        if (threadIdx.x < 2) {
            int64_t sum = 0;
            for (unsigned b = 0; b < gridDim.x; ++b) sum += block_counts[int64_t(gridDim.x) * L + 2 * b + threadIdx.x];
            words[threadIdx.x] = sum;
        }
    }
    block_exclusive_scan(totals, L, scratch);
    for (int l = threadIdx.x; l < L; l += kBlockThreads) {
        int next = totals[l] + before[l];
        for (int w = 0; w < kWarpsPerBlock; ++w) {
            const int c = counters[w * L + l];
            counters[w * L + l] = next;
            next += c;
        }
    }
    __syncthreads();

    int* mine = counters + warp * L;
    walk_entries(topk_idx, range.begin, range.end, L, [&](int64_t i, int e, unsigned peers) {
        const int slot = e >= 0 ? mine[e] + __popc(peers & lanemask_lt()) : -1;
        __syncwarp();
        if (e >= 0 && lane == __ffs(peers) - 1) mine[e] += __popc(peers);
        __syncwarp();
        if (i < range.end) recv_slot[i] = slot;
    });
}

// ---------------------------------------------------------------------------------------------------------------
// permute / unpermute: a work item is one chunk of kChunkVecs 16-byte vectors of one received row, done by one
// warp; warps stride over items, grids are one full wave. Chunks (not whole rows) keep the tail balanced and
// give small batches enough warps.

// Work item `item` of a grid over rows split into chunks_per_row chunks: its row and the row's vectors [first, last).
struct RowChunk {
    int64_t row, first, last;
};

__device__ __forceinline__ RowChunk row_chunk(int64_t item, int64_t chunks_per_row, int64_t row_vecs) {
    const int64_t row = item / chunks_per_row;
    const int64_t first = (item - row * chunks_per_row) * kChunkVecs;
    return {row, first, min(first + kChunkVecs, row_vecs)};
}

struct RowSlots {
    int count;  // valid slots of the row, compacted into the warp's list in top-k column order
    int own;    // lane k's slot (-1 when invalid or k >= num_topk)
};

// Slots outside [0, num_rows) count as invalid.
__device__ __forceinline__ RowSlots row_slots(const int32_t* recv_slot, int64_t r, int num_topk, int64_t num_rows,
                                              int* list) {
    const int lane = threadIdx.x & 31;
    int s = lane < num_topk ? __ldg(recv_slot + r * num_topk + lane) : -1;
    if (s < 0 || s >= num_rows) s = -1;
    const unsigned valid = __ballot_sync(kFullMask, s >= 0);
    if (s >= 0) list[__popc(valid & lanemask_lt())] = s;
    __syncwarp();
    return {__popc(valid), s};
}

__global__ void __launch_bounds__(kBlockThreads)
    permute_kernel(const int4* __restrict__ x, const int32_t* __restrict__ recv_slot, const float* __restrict__ weights,
                   const float* __restrict__ scales, int64_t num_recv_rows, int num_topk, int64_t row_vecs,
                   int64_t chunks_per_row, int64_t num_scales, int64_t num_rows, int4* __restrict__ out_x,
                   float* __restrict__ out_probs, float* __restrict__ out_scales, uint8_t* __restrict__ covered) {
    __shared__ int lists[kWarpsPerBlock][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* list = lists[warp];
    const int64_t num_items = num_recv_rows * chunks_per_row;
    for (int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + warp; item < num_items;
         item += int64_t(gridDim.x) * kWarpsPerBlock) {
        const RowChunk chunk = row_chunk(item, chunks_per_row, row_vecs);
        const int64_t r = chunk.row, first = chunk.first;
        const RowSlots row = row_slots(recv_slot, r, num_topk, num_rows, list);
        const int n = row.count;
        if (first == 0 && row.own >= 0) {  // per-row metadata: the row's first chunk
            covered[row.own] = 1;
            if (out_probs != nullptr) out_probs[row.own] = __ldg(weights + r * num_topk + lane);
        }
        if (first == 0 && n > 0 && out_scales != nullptr) {
            for (int64_t c = lane; c < num_scales; c += 32) {
                const float s = __ldg(scales + r * num_scales + c);
                for (int j = 0; j < n; ++j) out_scales[int64_t(list[j]) * num_scales + c] = s;
            }
        }
        if (n > 0) {
            const int64_t v = first + lane;
            const int4* src = x + r * row_vecs + v;
            int4 buf[kPermuteUnroll];
#pragma unroll
            for (int u = 0; u < kPermuteUnroll; ++u)
                if (v + 32 * u < row_vecs) buf[u] = __ldg(src + 32 * u);
            for (int j = 0; j < n; ++j) {
                int4* dst = out_x + int64_t(list[j]) * row_vecs + v;
#pragma unroll
                for (int u = 0; u < kPermuteUnroll; ++u)
                    if (v + 32 * u < row_vecs) dst[32 * u] = buf[u];
            }
        }
        __syncwarp();  // the list is rewritten for the next item
    }
}

// Rows no slot named are the padding at the end of each expert block: only they are written here.
__global__ void __launch_bounds__(kBlockThreads)
    zero_padding_kernel(const uint8_t* __restrict__ covered, int64_t num_rows, int64_t row_vecs, int64_t num_scales,
                        int4* __restrict__ out_x, float* __restrict__ out_probs, float* __restrict__ out_scales) {
    const int lane = threadIdx.x & 31;
    const int4 zero = make_int4(0, 0, 0, 0);
    for (int64_t row = (int64_t(blockIdx.x) * kBlockThreads + threadIdx.x) / 32; row < num_rows;
         row += int64_t(gridDim.x) * kWarpsPerBlock) {
        if (__ldg(covered + row)) continue;
        int4* dst = out_x + row * row_vecs;
        for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = zero;
        if (out_probs != nullptr && lane == 0) out_probs[row] = 0.0f;
        if (out_scales != nullptr)
            for (int64_t c = lane; c < num_scales; c += 32) out_scales[row * num_scales + c] = 0.0f;
    }
}

// out[r] = sum over the row's valid slots, top-k column ascending, in fp32 from 0.0f, rounded once. Every output
// row is written (rows without slots get zeros), so out needs no memset.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    unpermute_kernel(const int4* __restrict__ y, const int32_t* __restrict__ recv_slot, int64_t num_recv_rows,
                     int num_topk, int64_t row_vecs, int64_t chunks_per_row, int64_t num_rows, int4* __restrict__ out) {
    __shared__ int lists[kWarpsPerBlock][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int* list = lists[warp];
    const int64_t num_items = num_recv_rows * chunks_per_row;
    for (int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + warp; item < num_items;
         item += int64_t(gridDim.x) * kWarpsPerBlock) {
        const RowChunk chunk = row_chunk(item, chunks_per_row, row_vecs);
        const int n = row_slots(recv_slot, chunk.row, num_topk, num_rows, list).count;
        int4* dst = out + chunk.row * row_vecs;
        for (int64_t v = chunk.first + lane; v < chunk.last; v += 32)
            dst[v] = sum_rows<T, kUnpermuteBatch>(y, row_vecs, list, n, v);
        __syncwarp();  // the list is rewritten for the next item
    }
}

}  // namespace permute_kernels
}  // namespace moe_ep
