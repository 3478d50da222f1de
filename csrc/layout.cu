// Dispatch layout: per-rank and per-expert token counts and the token-to-rank mask, from top-k expert ids.
#include "common.cuh"
#include "context.h"

namespace moe_ep {

constexpr int kLayoutThreads = 256;

// One thread per token (grid-stride). Block-local histograms in shared memory, flushed with one atomic per
// nonzero bin. Experts are laid out contiguously over ranks: rank = expert / (E / R).
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(const int64_t* __restrict__ topk_idx, int num_tokens,
                                                                int num_topk, int num_experts, int num_ranks,
                                                                int32_t* per_rank, int32_t* per_expert,
                                                                uint8_t* is_token_in_rank) {
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
__global__ void __launch_bounds__(kRoutingThreads) routing_map_topk_kernel(const uint8_t* __restrict__ routing_map,
                                                                          const float* __restrict__ probs,
                                                                          int num_tokens, int num_experts, int topk,
                                                                          int64_t* topk_idx, float* topk_weights) {
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

using namespace moe_ep;

extern "C" int moe_ep_get_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                          int64_t num_experts, int64_t num_ranks, int32_t* per_rank,
                                          int32_t* per_expert, uint8_t* is_token_in_rank, void* stream) {
    if (num_ranks < 1 || num_ranks > 32 || num_experts % num_ranks != 0 || num_experts > 12288)
        return set_error(-1, "moe_ep_get_dispatch_layout: need num_experts divisible by 1 <= num_ranks <= 32 and "
                             "num_experts <= 12288");
    if (num_tokens == 0) return 0;
    const int blocks = int((num_tokens + kLayoutThreads - 1) / kLayoutThreads < 64
                               ? (num_tokens + kLayoutThreads - 1) / kLayoutThreads : 64);
    const size_t smem = size_t(num_experts + num_ranks) * sizeof(int);
    layout_kernel<<<blocks, kLayoutThreads, smem, static_cast<cudaStream_t>(stream)>>>(
        topk_idx, int(num_tokens), int(num_topk), int(num_experts), int(num_ranks), per_rank, per_expert,
        is_token_in_rank);
    return check_launch("layout_kernel");
}

extern "C" int moe_ep_routing_map_topk(const uint8_t* routing_map, const float* probs, int64_t num_tokens,
                                       int64_t num_experts, int64_t topk, int64_t* topk_idx, float* topk_weights,
                                       void* stream) {
    if (num_tokens < 0 || num_experts < 1 || topk < 1 || topk > num_experts || num_tokens * num_experts > INT32_MAX)
        return set_error(-1, "moe_ep_routing_map_topk: need 1 <= topk <= num_experts and num_tokens * num_experts < 2^31");
    if (num_tokens == 0) return 0;
    const int64_t blocks = (num_tokens + kRoutingThreads / 32 - 1) / (kRoutingThreads / 32);
    routing_map_topk_kernel<<<int(blocks < 1024 ? blocks : 1024), kRoutingThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        routing_map, probs, int(num_tokens), int(num_experts), int(topk), topk_idx, topk_weights);
    return check_launch("routing_map_topk_kernel");
}
