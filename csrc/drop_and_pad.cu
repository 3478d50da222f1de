// Entry points of drop-and-pad's kernels (csrc/moe_ep.h, "Drop-and-pad"); device code in kernels/drop_and_pad.cuh.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "context.h"
#include "kernels/drop_and_pad.cuh"
#include "moe_ep.h"

using namespace moe_ep;
using namespace moe_ep::pad_kernels;

namespace {

// Grid-stride grids of warps per row: enough blocks to fill the device several times over, never more than rows.
int64_t warp_grid(int64_t rows) {
    return std::max<int64_t>(1, std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, int64_t(1) << 16));
}

bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

extern "C" int moe_ep_pad_select(const uint8_t* routing_map, int64_t num_tokens, int64_t num_experts, int64_t capacity,
                                 int64_t* tokens, int64_t* experts, int32_t* slot, void* stream) {
    if (num_tokens < 0 || num_experts < 1 || num_experts > INT32_MAX || capacity < 0 || capacity > num_tokens ||
        num_experts * capacity > INT32_MAX)
        return set_error(-1,
                         "moe_ep_pad_select: need num_tokens >= 0, 1 <= num_experts, 0 <= capacity <= num_tokens and "
                         "num_experts * capacity within int32");
    if (num_tokens == 0) return 0;
    select_pairs_kernel<<<unsigned(num_experts), kSelectThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        routing_map, num_tokens, num_experts, capacity, tokens, experts, slot);
    return check_launch("select_pairs_kernel");
}

extern "C" int moe_ep_pad_arrange(const void* in, const int64_t* tokens, const float* probs, int64_t num_in,
                                  int64_t row_bytes, int64_t groups, int64_t local, int64_t capacity, int64_t block,
                                  int64_t inverse, void* out, float* out_probs, void* stream) {
    if (num_in < 0 || row_bytes < 16 || row_bytes % 16 != 0 || groups < 1 || local < 1 || capacity < 0 ||
        block < groups * capacity || (inverse != 0 && tokens != nullptr) ||
        (probs == nullptr) != (out_probs == nullptr) || !aligned16(in) || !aligned16(out))
        return set_error(-1,
                         "moe_ep_pad_arrange: need row_bytes a positive multiple of 16, 16-byte aligned rows, "
                         "groups, local >= 1, 0 <= capacity, block >= groups * capacity, no tokens when inverse, and "
                         "probs given together with out_probs");
    const int64_t num_out = inverse ? groups * local * capacity : local * block;
    if (num_out > INT32_MAX || groups * local * capacity > INT32_MAX || local * block > INT32_MAX)
        return set_error(-1, "moe_ep_pad_arrange: more than int32 rows");
    if (num_out == 0) return 0;
    const Arrangement a{int(groups), int(local), int(capacity), int(block), int(inverse != 0)};
    arrange_rows_kernel<<<unsigned(warp_grid(num_out)), kBlockThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const int4*>(in), tokens, probs, a, num_in, row_bytes / 16, int(num_out), static_cast<int4*>(out),
        out_probs);
    return check_launch("arrange_rows_kernel");
}

extern "C" int moe_ep_pad_sum(const void* y, const int32_t* slot, const float* weights, int64_t num_tokens,
                              int64_t num_slots, int64_t capacity, int64_t block, int64_t num_y_rows, int64_t hidden,
                              int64_t dtype, void* out, float* out_weights, void* stream) {
    const int64_t elem_bytes = dtype_bytes(dtype);
    const int64_t row_bytes = hidden * elem_bytes;
    const size_t smem = sizeof(int) * size_t(std::max<int64_t>(num_slots, 0));
    if (elem_bytes == 0 || num_tokens < 0 || num_slots < 1 || smem > MOE_EP_PAD_MAX_SLOTS * sizeof(int) ||
        num_y_rows < 0 || row_bytes < 16 || row_bytes % 16 != 0 || !aligned16(y) || !aligned16(out) ||
        (weights == nullptr) != (out_weights == nullptr))
        return set_error(-1, "moe_ep_pad_sum: need an FP32/BF16/FP16 dtype code, 1 <= num_slots <= " +
                                 std::to_string(MOE_EP_PAD_MAX_SLOTS) +
                                 ", rows a positive multiple of 16 bytes, 16-byte aligned y and out, and weights "
                                 "given together with out_weights");
    const int64_t row_vecs = row_bytes / 16;
    const int64_t chunks = (row_vecs + kBlockThreads - 1) / kBlockThreads;
    if (num_tokens > INT32_MAX || chunks > 65535 || capacity < 1 || block < capacity || block > INT32_MAX)
        return set_error(-1,
                         "moe_ep_pad_sum: need at most 2^31 tokens and 65535 x 256 vectors per row, capacity >= 1 and "
                         "capacity <= block within int32");
    if (num_tokens == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(chunks));
    return by_dtype(dtype, [&](auto t) {
        sum_slots_kernel<decltype(t)>
            <<<grid, kBlockThreads, smem, s>>>(static_cast<const int4*>(y), slot, weights, num_slots, int(capacity),
                                               int(block), num_y_rows, row_vecs, static_cast<int4*>(out), out_weights);
        return check_launch("sum_slots_kernel");
    });
}
