// Device code of the dispatch layout (per-rank and per-expert token counts and the token-to-rank mask, from top-k
// expert ids) and of the routing-map conversion; launched from csrc/api.cu.
#pragma once

#include "../common.cuh"

namespace moe_ep {

constexpr int kLayoutThreads = 256;

// One thread per token (grid-stride). Block-local histograms in shared memory, flushed with one atomic per
// nonzero bin. Experts are laid out contiguously over ranks: rank = expert / (E / R).
__global__ void __launch_bounds__(kLayoutThreads)
    layout_kernel(const int64_t* __restrict__ topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                  int32_t* per_rank, int32_t* per_expert, uint8_t* is_token_in_rank) {
    extern __shared__ int s_counts[];  // [num_experts] then [num_ranks]
    int* s_rank = s_counts + num_experts;
    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) s_counts[i] = 0;
    __syncthreads();
    const int experts_per_rank = num_experts / num_ranks;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        uint32_t mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t e = __ldg(topk_idx + int64_t(t) * num_topk + k);
            if (e < 0 || e >= num_experts) continue;  // out-of-range ids: rejected by the dispatch that follows
            atomicAdd(&s_counts[e], 1);
            mask |= 1u << (int(e) / experts_per_rank);
        }
        for (int r = 0; r < num_ranks; ++r) {
            const bool in = (mask >> r) & 1u;
            is_token_in_rank[int64_t(t) * num_ranks + r] = in;
            if (in) atomicAdd(&s_rank[r], 1);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
        if (s_counts[i]) atomicAdd(&per_expert[i], s_counts[i]);
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x)
        if (s_rank[r]) atomicAdd(&per_rank[r], s_rank[r]);
}

// One warp per token: the token's selected experts (nonzero bytes of its routing-map row) fill its top-k slots in
// ascending expert order, their probabilities gathered alongside; slots past them get -1 / 0.
constexpr int kRoutingThreads = 256;
__global__ void __launch_bounds__(kRoutingThreads)
    routing_map_topk_kernel(const uint8_t* __restrict__ routing_map, const float* __restrict__ probs, int num_tokens,
                            int num_experts, int topk, int64_t* topk_idx, float* topk_weights) {
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (kRoutingThreads / 32);
    for (int t = blockIdx.x * (kRoutingThreads / 32) + (threadIdx.x >> 5); t < num_tokens; t += warps) {
        const int64_t row = int64_t(t) * num_experts;
        int count = 0;
        for (int c0 = 0; c0 < num_experts && count < topk; c0 += 32) {
            const int c = c0 + lane;
            const bool selected = c < num_experts && __ldg(routing_map + row + c) != 0;
            const uint32_t ballot = __ballot_sync(0xffffffffu, selected);
            const int k = count + __popc(ballot & ((1u << lane) - 1u));
            if (selected && k < topk) {
                topk_idx[int64_t(t) * topk + k] = c;
                topk_weights[int64_t(t) * topk + k] = __ldg(probs + row + c);
            }
            count += __popc(ballot);
        }
        for (int k = count + lane; k < topk; k += 32) {
            topk_idx[int64_t(t) * topk + k] = -1;
            topk_weights[int64_t(t) * topk + k] = 0.0f;
        }
    }
}

}  // namespace moe_ep
