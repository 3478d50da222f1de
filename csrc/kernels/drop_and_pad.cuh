#pragma once
// Device code of drop-and-pad's fixed-capacity layout (csrc/moe_ep.h; launched from csrc/drop_and_pad.cu): each
// expert's first `capacity` tokens as a stable descending sort of its routing-map column takes them, rows moved
// between the token, pair and expert-major orders, and each token's pair rows summed back.
#include <cstdint>
#include <cuda_bf16.h>

#include "../common.cuh"

namespace moe_ep {
namespace pad_kernels {

constexpr int kSelectThreads = 512;
constexpr int kWarpsPerBlock = 8;
constexpr int kBlockThreads = kWarpsPerBlock * 32;
constexpr int kSumBatch = 4;  // pair rows whose vectors a thread loads together, then sums in order (8 spills)
constexpr unsigned kFullMask = 0xffffffffu;

// One block per expert e (blockIdx.x): the marked tokens of column e in token order, then the unmarked ones, the
// first `capacity` of them taken. tokens[e * capacity + c] gets the token of pair c, experts[...] e, slot[t, e] the
// pair e * capacity + c, or -1 for a token the expert does not take. Every slot of the column is written.
__global__ void __launch_bounds__(kSelectThreads)
    select_pairs_kernel(const uint8_t* __restrict__ routing_map, int64_t num_tokens, int64_t num_experts,
                        int64_t capacity, int64_t* __restrict__ tokens, int64_t* __restrict__ experts,
                        int32_t* __restrict__ slot) {
    __shared__ int scratch[33];
    const int64_t e = blockIdx.x;
    int marked = 0;
    for (int64_t t = threadIdx.x; t < num_tokens; t += blockDim.x) marked += routing_map[t * num_experts + e] != 0;
    int total_marked = 0;
    block_exclusive_sum(marked, scratch, total_marked);
    int seen_marked = 0;  // marked tokens of earlier chunks
    for (int64_t base = 0; base < num_tokens; base += blockDim.x) {
        const int64_t t = base + threadIdx.x;
        const int flag = t < num_tokens && routing_map[t * num_experts + e] != 0;
        int chunk_marked = 0;
        const int before = block_exclusive_sum(flag, scratch, chunk_marked);
        if (t < num_tokens) {
            // the chunk's valid threads are a prefix, so the unmarked tokens before t number threadIdx.x - before
            const int64_t rank =
                flag ? seen_marked + before : total_marked + (base - seen_marked) + threadIdx.x - before;
            const bool taken = rank < capacity;
            slot[t * num_experts + e] = taken ? int32_t(e * capacity + rank) : -1;
            if (taken) {
                tokens[e * capacity + rank] = t;
                experts[e * capacity + rank] = e;
            }
        }
        seen_marked += chunk_marked;
    }
}

// Row i of the output and the input row it copies (-1: a padding row, zero). Forward (inverse = 0): the output is
// [L * block] expert-major rows, row (l, j) with j < G * C copying pair row q = (g * L + l) * C + c (j = g * C + c),
// read through tokens[q] when tokens are given; inverse: the output is the [G * L * C] pair rows, row q copying
// expert-major row l * block + g * C + c.
struct Arrangement {
    int groups, local, capacity, block, inverse;
};

struct Source {
    int64_t row;  // the input row (-1: padding)
    int pair;     // its pair index (its place in the pair order)
};

// 32-bit index math (the entry point checks every row count fits): 64-bit division is a call that spills.
__device__ __forceinline__ Source source_row(const Arrangement& a, int i) {
    if (a.inverse) {
        const int g = i / (a.local * a.capacity), r = i - g * a.local * a.capacity;
        const int l = r / a.capacity, c = r - l * a.capacity;
        return {int64_t(l) * a.block + g * a.capacity + c, i};
    }
    const int l = i / a.block, j = i - l * a.block;
    if (j >= a.groups * a.capacity) return {-1, -1};
    const int g = j / a.capacity, c = j - g * a.capacity;
    const int pair = (g * a.local + l) * a.capacity + c;
    return {pair, pair};
}

// One warp per output row (grid-stride): the row copied from its source (16-byte vectors; zero where there is none
// or it lies outside [0, num_in)), and with probs its prob: probs[token * G * L + q / C] through tokens, else
// probs[source], 0 for padding.
__global__ void __launch_bounds__(kBlockThreads)
    arrange_rows_kernel(const int4* __restrict__ in, const int64_t* __restrict__ tokens,
                        const float* __restrict__ probs, Arrangement a, int64_t num_in, int64_t row_vecs, int num_out,
                        int4* __restrict__ out, float* __restrict__ out_probs) {
    const int lane = threadIdx.x & 31;
    for (int i = blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5); i < num_out; i += gridDim.x * kWarpsPerBlock) {
        const Source from = source_row(a, i);
        int64_t src = from.row;
        if (src >= 0 && tokens != nullptr) src = __ldg(tokens + src);
        const bool valid = src >= 0 && src < num_in;
        int4* dst = out + i * row_vecs;
        if (valid) {
            const int4* row = in + src * row_vecs;
            for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = __ldg(row + v);
        } else {
            for (int64_t v = lane; v < row_vecs; v += 32) dst[v] = make_int4(0, 0, 0, 0);
        }
        if (out_probs != nullptr && lane == 0) {
            const int64_t at = tokens != nullptr ? src * (a.groups * a.local) + from.pair / a.capacity : src;
            out_probs[i] = valid ? __ldg(probs + at) : 0.0f;
        }
    }
}

// Block (t, chunk) = (blockIdx.x, blockIdx.y): vectors [chunk * blockDim.x, (chunk + 1) * blockDim.x) of
// out[t] = y[row(slot[t, k])] summed over k ascending in fp32 from 0.0f, rounded once to T, one vector per thread;
// pair p's row is (p / capacity) * block + p % capacity, and pairs < 0 or with a row past num_y_rows add nothing.
// With weights, chunk 0 writes out_weights[t, k] = 0.0f + weights[row] (0 for an invalid pair; the addition turns
// -0.0 into +0.0, as a sum from zeros does). Warp 0 first compacts the valid rows into shared memory (num_slots
// ints).
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    sum_slots_kernel(const int4* __restrict__ y, const int32_t* __restrict__ slot, const float* __restrict__ weights,
                     int64_t num_slots, int capacity, int block, int64_t num_y_rows, int64_t row_vecs,
                     int4* __restrict__ out, float* __restrict__ out_weights) {
    extern __shared__ int list[];
    __shared__ int count;
    const int64_t t = blockIdx.x;
    const int32_t* row = slot + t * num_slots;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const bool weigh = out_weights != nullptr && blockIdx.y == 0;
        int n = 0;
        for (int64_t k0 = 0; k0 < num_slots; k0 += 32) {
            const int64_t k = k0 + lane;
            const int p = k < num_slots ? __ldg(row + k) : -1;
            int s = p < 0 ? -1 : p / capacity * block + p % capacity;
            if (s >= num_y_rows) s = -1;
            const unsigned valid = __ballot_sync(kFullMask, s >= 0);
            if (s >= 0) list[n + __popc(valid & ((1u << lane) - 1u))] = s;
            if (weigh && k < num_slots) out_weights[t * num_slots + k] = 0.0f + (s >= 0 ? __ldg(weights + s) : 0.0f);
            n += __popc(valid);
        }
        if (lane == 0) count = n;
    }
    __syncthreads();
    const int64_t v = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
    if (v < row_vecs) out[t * row_vecs + v] = sum_rows<T, kSumBatch>(y, row_vecs, list, count, v);
}

}  // namespace pad_kernels
}  // namespace moe_ep
