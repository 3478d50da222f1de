// The kernel library's C ABI (csrc/moe_ep.h) for every kernel: argument checks and launch code on the host side;
// the device code lives in csrc/kernels/ (as DeepEP keeps its host API apart from its kernels). The context's
// lifetime (buffer, CUDA IPC, error record, host reads) is csrc/runtime.cu.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

#include "context.h"
#include "kernels/intranode.cuh"
#include "kernels/layout.cuh"
#include "kernels/low_latency.cuh"
#include "kernels/permute.cuh"
#include "moe_ep.h"

namespace moe_ep {

// Copy-engine combine settings.
static int check_copy(int64_t piece_rows, int64_t streams, const int32_t* host_counts) {
    if (piece_rows < 1 || streams < 1 || streams > MOE_EP_MAX_COPY_STREAMS || host_counts == nullptr)
        return set_error(-1, "copy engine: need copy_piece_rows >= 1, copy_streams in [1, " +
                                 std::to_string(MOE_EP_MAX_COPY_STREAMS) + "] and host_counts");
    return 0;
}

// Copy-engine combine, host side: the rows this rank sends back to each peer must fit the peer's region.
static int check_copy_rows(const Context* ctx, const int32_t* counts, int64_t row_bytes) {
    const int R = ctx->dev.num_ranks, me = ctx->dev.rank;
    for (int d = 0; d < R; ++d) {
        const int64_t rows = counts[d * R + me];
        if (d != me && (rows > kMaxRegionRows || rows * row_bytes > ctx->dev.region_bytes))
            return set_error(-1, "combine: " + std::to_string(rows) + " rows of " + std::to_string(row_bytes) +
                                     " bytes do not fit a peer staging region of " +
                                     std::to_string(ctx->dev.region_bytes) + " bytes; pass a larger num_nvl_bytes");
    }
    return 0;
}

// Copy-engine combine, host side: enqueue on the copy streams, piece by piece (interleaved over peers), the copy
// of `counts(d)` rows of `row_bytes` from `src(d)` to the start of peer d's region for this rank; each piece flags
// its arrival there.
template <typename Count, typename Src>
static int copy_rows(Context* ctx, Count counts, Src src, int64_t row_bytes, int64_t min_piece_rows, int streams) {
    const int R = ctx->dev.num_ranks, me = ctx->dev.rank;
    for (int j = 0; j < kMaxPieces; ++j) {
        for (int k = 1; k < R; ++k) {
            const int d = (me + k) % R, count = counts(d);
            const int piece = piece_rows(count, int(min_piece_rows)), begin = j * piece;
            if (begin >= count) continue;
            const int64_t offset = int64_t(begin) * row_bytes;
            char* dst = ctx->dev.bufs[d] + kStagingOffset + int64_t(me) * ctx->dev.region_bytes + offset;
            int* flag = &reinterpret_cast<CopyFlags*>(ctx->dev.bufs[d] + kCopyFlagsOffset)->arrived[me][j];
            if (int err = copy_piece(ctx, j % streams, dst, src(d) + offset,
                                     size_t(std::min(piece, count - begin)) * row_bytes, flag))
                return err;
        }
    }
    return 0;
}

int64_t pull_rows(const DevCtx& c, int64_t row_bytes, int num_topk) {
    return std::min(pull_weights_offset(c, num_topk) / row_bytes, int64_t(kMaxRegionRows));
}

int launch_check(const Context* ctx, int64_t num_sms, int64_t num_send_warps, int64_t num_send_blocks) {
    int device_sms = 0;
    int err = check_cuda(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, ctx->device),
                         "cudaDeviceGetAttribute");
    if (err) return err;
    if (num_sms < 1 || num_sms > device_sms)
        return set_error(-1, "num_sms=" + std::to_string(num_sms) + " must lie in [1, " + std::to_string(device_sms) +
                                 "] (all blocks must be resident at once)");
    if (num_send_blocks > 0) {
        if (num_send_blocks >= num_sms)
            return set_error(-1, "num_send_blocks=" + std::to_string(num_send_blocks) +
                                     " must be < num_sms=" + std::to_string(num_sms));
    } else if (num_send_warps < 0 || num_send_warps >= kWarps)
        return set_error(-1, "num_send_warps=" + std::to_string(num_send_warps) + " must lie in [0, " +
                                 std::to_string(kWarps - 1) + "]");
    return 0;
}

// The dispatch kernel's launch cases (DeepEP's SWITCH_* macros): each binds a template parameter `name` to the
// mode at hand as a compile-time constant and runs the statement that follows, so every combination is its own
// kernel with only its own mode's code and registers (at EP1 2x faster on BF16 dispatch than one kernel reading the
// modes at run time, and never slower: benchmarks/RESULTS.md).
#define SWITCH_MODE(name, on, ...)  \
    do {                            \
        if (on) {                   \
            constexpr int name = 1; \
            __VA_ARGS__;            \
        } else {                    \
            constexpr int name = 0; \
            __VA_ARGS__;            \
        }                           \
    } while (false)
#define SWITCH_TOPK(name, topk, ...)          \
    do {                                      \
        if ((topk) == kExpertTopk) {          \
            constexpr int name = kExpertTopk; \
            __VA_ARGS__;                      \
        } else if ((topk) == kLocalTopk) {    \
            constexpr int name = kLocalTopk;  \
            __VA_ARGS__;                      \
        } else {                              \
            constexpr int name = kNoTopk;     \
            __VA_ARGS__;                      \
        }                                     \
    } while (false)

namespace permute_kernels {

size_t expert_slots_smem(int num_local_experts) {
    // counters [kWarpsPerBlock][L], aligned totals [L], counts of earlier blocks [L], the block scan's scratch [33]
    return sizeof(int) * (size_t(kWarpsPerBlock + 2) * num_local_experts + 33);
}

// Blocks of `kernel` (kBlockThreads threads, smem bytes) resident on the current device at once, cached per device
// in `cache` (one per kernel and launch site): grid-stride grids are one full wave.
int resident_blocks(const void* kernel, size_t smem, std::atomic<int>* cache, int* blocks) {
    int device = 0;
    if (int err = check_cuda(cudaGetDevice(&device), "cudaGetDevice")) return err;
    if (device < kMaxDevices) {
        if (const int cached = cache[device].load(std::memory_order_relaxed)) {
            *blocks = cached;
            return 0;
        }
    }
    int sms = 0, per_sm = 0;
    if (int err = check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                             "cudaDeviceGetAttribute(multiProcessorCount)"))
        return err;
    if (int err = check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kBlockThreads, smem),
                             "cudaOccupancyMaxActiveBlocksPerMultiprocessor"))
        return err;
    if (per_sm < 1) return set_error(-1, "permute kernels: a block does not fit on one SM");
    *blocks = sms * per_sm;
    if (device < kMaxDevices) cache[device].store(*blocks, std::memory_order_relaxed);
    return 0;
}

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

bool aligned16(const void* p) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace permute_kernels
}  // namespace moe_ep

using namespace moe_ep;
using namespace moe_ep::permute_kernels;

// The outputs every notify writes.
static NotifyArgs notify_outputs(int32_t* rank_prefix_matrix, int32_t* send_pos, int32_t* send_list, int32_t* info,
                                 int64_t num_tokens, int64_t list_stride, const int32_t* meta) {
    NotifyArgs a{};
    a.check_meta = meta != nullptr;
    for (int w = 0; a.check_meta && w < kMetaWords; ++w) a.meta[w] = meta[w];
    a.rpm = rank_prefix_matrix;
    a.send_pos = send_pos;
    a.send_list = send_list;
    a.info = info;
    a.num_tokens = int(num_tokens);
    a.list_stride = int(list_stride);
    return a;
}

extern "C" int moe_ep_notify_dispatch(void* handle, const int32_t* num_tokens_per_rank, const int32_t* num_invalid,
                                      const uint8_t* is_token_in_rank, int64_t num_tokens, int64_t list_stride,
                                      int32_t* rank_prefix_matrix, int32_t* send_pos, int32_t* send_list, int32_t* info,
                                      const int32_t* meta, const int32_t* num_tokens_per_expert, int64_t num_experts,
                                      void* stream) {
    const Context* ctx = static_cast<const Context*>(handle);
    if (num_tokens > list_stride) return set_error(-1, "moe_ep_notify_dispatch: list_stride < num_tokens");
    if (num_tokens_per_rank != nullptr && (num_invalid == nullptr || rank_prefix_matrix == nullptr || info == nullptr))
        return set_error(-1, "moe_ep_notify_dispatch: a count exchange needs num_invalid, rank_prefix_matrix and info");
    if (num_tokens_per_expert != nullptr && (num_tokens_per_rank == nullptr || num_experts < 1 ||
                                             num_experts > kMaxExperts || num_experts % ctx->dev.num_ranks != 0))
        return set_error(-1,
                         "moe_ep_notify_dispatch: per-expert counts need a count exchange and num_experts a "
                         "multiple of the ranks in [1, " +
                             std::to_string(kMaxExperts) + "]");
    NotifyArgs a = notify_outputs(rank_prefix_matrix, send_pos, send_list, info, num_tokens, list_stride, meta);
    a.num_tokens_per_expert = num_tokens_per_expert;
    a.num_experts = int(num_experts);
    a.num_tokens_per_rank = num_tokens_per_rank;
    a.num_invalid = num_invalid;
    a.in_rank = is_token_in_rank;
    notify_kernel<<<1 + ctx->dev.num_ranks, kNotifyThreads, 0, static_cast<cudaStream_t>(stream)>>>(ctx->dev, a);
    return check_launch("notify_kernel");
}

extern "C" int moe_ep_notify_experts(void* handle, const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                     int64_t num_experts, int64_t alignment, int64_t list_stride,
                                     int32_t* rank_prefix_matrix, int32_t* send_pos, int32_t* send_list,
                                     uint8_t* is_token_in_rank, int32_t* expert_pos, int32_t* send_offset,
                                     int32_t* info, const int32_t* meta, void* stream) {
    const Context* ctx = static_cast<const Context*>(handle);
    const int R = ctx->dev.num_ranks;
    if (num_tokens > list_stride) return set_error(-1, "moe_ep_notify_experts: list_stride < num_tokens");
    if (num_experts < 1 || num_experts > kMaxExperts || num_experts % R != 0 || num_topk < 1 || alignment < 1)
        return set_error(-1, "moe_ep_notify_experts: need num_experts a multiple of " + std::to_string(R) + " in [1, " +
                                 std::to_string(kMaxExperts) + "], num_topk >= 1 and alignment >= 1");
    if (num_tokens > 0 && (topk_idx == nullptr || is_token_in_rank == nullptr || expert_pos == nullptr))
        return set_error(-1, "moe_ep_notify_experts: topk_idx, is_token_in_rank and expert_pos are required");
    NotifyArgs a = notify_outputs(rank_prefix_matrix, send_pos, send_list, info, num_tokens, list_stride, meta);
    a.topk_idx = topk_idx;
    a.in_rank_out = is_token_in_rank;
    a.expert_pos = expert_pos;
    a.send_offset = send_offset;
    a.num_topk = int(num_topk);
    a.num_experts = int(num_experts);
    a.alignment = int(alignment);
    a.derive = true;
    notify_kernel<<<1 + R + int(num_experts), kNotifyThreads, 0, static_cast<cudaStream_t>(stream)>>>(ctx->dev, a);
    return check_launch("notify_kernel");
}

extern "C" int moe_ep_barrier(void* handle, void* stream) {
    const Context* ctx = static_cast<const Context*>(handle);
    barrier_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(ctx->dev);
    return check_launch("barrier_kernel");
}

extern "C" int moe_ep_dispatch(void* handle, const moe_ep_dispatch_params* params, void* stream) {
    const Context* ctx = static_cast<const Context*>(handle);
    const moe_ep_dispatch_params& p = *params;
    if (int err = launch_check(ctx, p.num_sms, p.num_send_warps, 0)) return err;
    if (p.num_topk > MOE_EP_MAX_TOPK) return set_error(-1, "num_topk > " + std::to_string(MOE_EP_MAX_TOPK));
    if (p.expert_major != 0 && (p.send_offset == nullptr || p.expert_info == nullptr || p.num_topk < 1))
        return set_error(-1, "expert-major dispatch needs top-k, send_offset and expert_info");
    const bool quantize = p.wire_fp8 != 0;
    if (quantize && p.x_elem_bytes != 2 && p.x_elem_bytes != 4)
        return set_error(-1, "FP8 quantization in the send path needs BF16 or FP32 input");
    const bool fp8_rows = quantize || p.fp8_in != 0;
    if (fp8_rows && p.hidden % 128 != 0) return set_error(-1, "FP8 rows need hidden % 128 == 0");
    SlotLayout sl;
    sl.payload_bytes = int(fp8_rows ? p.hidden : p.hidden * p.x_elem_bytes);
    if (sl.payload_bytes % 16 != 0) return set_error(-1, "row bytes must be a multiple of 16");
    sl.num_scales = fp8_rows ? int(p.hidden / 128) : 0;
    sl.scales_off = sl.payload_bytes;
    sl.idx_off = sl.scales_off + 4 * sl.num_scales;
    sl.w_off = sl.idx_off + 4 * int(p.num_topk);
    sl.src_off = sl.w_off + 4 * int(p.num_topk);
    sl.slot_bytes = (sl.src_off + 4 + 15) / 16 * 16;
    const int hist_bytes = int((p.num_local_experts * 4 + 127) / 128 * 128);
    if (hist_bytes > 48 * 1024) return set_error(-1, "too many local experts for the dispatch kernel (max 12288)");
    const size_t smem = size_t(hist_bytes);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int grid = int(p.num_sms);
    if (p.num_send_warps < 1) return set_error(-1, "dispatch needs sender warps");
    if (p.fp8_in != 0 && quantize) return set_error(-1, "FP8 input rows cannot be quantized again (wire_fp8)");
#define DISPATCH_LAUNCH_CASE(kQuant)                                                   \
    SWITCH_MODE(kFp8Out, dispatch_fp8_out(p, quantize),                                \
                SWITCH_TOPK(kTopk, dispatch_topk(p),                                   \
                            SWITCH_MODE(kPull, p.pull != 0,                            \
                                        dispatch_kernel<kQuant, kFp8Out, kTopk, kPull> \
                                        <<<grid, kThreads, smem, s>>>(ctx->dev, p, sl, hist_bytes))));
    if (!quantize) {
        DISPATCH_LAUNCH_CASE(0);
    } else if (p.x_elem_bytes == 2) {
        DISPATCH_LAUNCH_CASE(1);
    } else {
        DISPATCH_LAUNCH_CASE(2);
    }
#undef DISPATCH_LAUNCH_CASE
    return check_launch("dispatch_kernel");
}

extern "C" int64_t moe_ep_pull_rows(void* handle, int64_t row_bytes, int64_t num_topk) {
    return row_bytes > 0 ? pull_rows(static_cast<const Context*>(handle)->dev, row_bytes, int(num_topk)) : 0;
}

extern "C" int moe_ep_combine(void* handle, const moe_ep_combine_params* params, void* stream) {
    const Context* ctx = static_cast<const Context*>(handle);
    const moe_ep_combine_params& p = *params;
    if (int err = launch_check(ctx, p.num_sms, p.num_send_warps, p.num_send_blocks)) return err;
    if (p.num_topk > MOE_EP_MAX_TOPK) return set_error(-1, "num_topk > " + std::to_string(MOE_EP_MAX_TOPK));
    const int64_t elem_bytes = dtype_bytes(p.dtype);
    if (elem_bytes == 0) return set_error(-1, "combine needs an FP32/BF16/FP16 dtype code (MOE_EP_DTYPE_*)");
    if ((p.hidden * elem_bytes) % 16 != 0) return set_error(-1, "row bytes must be a multiple of 16");
    if (p.topk_idx != nullptr && (p.idx_topk < 1 || p.idx_topk > MOE_EP_MAX_TOPK || p.num_local_experts < 1))
        return set_error(-1, "combine order: need 1 <= idx_topk <= " + std::to_string(MOE_EP_MAX_TOPK) +
                                 " and num_local_experts >= 1; got idx_topk=" + std::to_string(p.idx_topk) +
                                 " num_local_experts=" + std::to_string(p.num_local_experts));
    const int64_t row_bytes = p.hidden * elem_bytes;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int grid = int(p.num_sms);
    const int R = ctx->dev.num_ranks, me = ctx->dev.rank;
    Context* mut = const_cast<Context*>(ctx);
    const bool ce = p.copy_engine != 0;
    char* own = static_cast<char*>(moe_ep_own_region(mut));
    if (p.x_in_region != 0 && (p.pull == 0 || p.x != own))
        return set_error(-1, "x_in_region: needs a pull combine whose x is this rank's own region (moe_ep_own_region)");
    if (p.pull != 0) {
        if (ce || p.num_send_warps != 0 || p.num_send_blocks != 0)
            return set_error(-1, "a pull combine has no senders and no copy engine");
        if (p.num_recv_rows > moe_ep_pull_rows(mut, row_bytes, p.num_topk))
            return set_error(-1, "pull combine: " + std::to_string(p.num_recv_rows) + " rows do not fit a region");
        if (p.host_counts == nullptr) return set_error(-1, "a pull combine needs host_counts");
        // The rows this rank received from each peer (and their weights) into its own region at the same offsets
        // as in x; its own tokens' rows stay in x, read there. With x_in_region the rows are there already (x is
        // the region), only the weights move. Peers finished reading the region (the caller's start barrier); the
        // barrier after the copies puts every rank's rows in place before anyone loads them.
        float* own_weights = reinterpret_cast<float*>(own + pull_weights_offset(ctx->dev, int(p.num_topk)));
        const char* x = static_cast<const char*>(p.x);
        int err = 0;
        for (int d = 0, first = 0; d < R && !err; first += p.host_counts[d * R + me], ++d) {
            const int count = p.host_counts[d * R + me];
            if (d == me || count == 0) continue;
            if (p.x_in_region == 0)
                err = check_cuda(cudaMemcpyAsync(own + first * row_bytes, x + first * row_bytes,
                                                 size_t(count * row_bytes), cudaMemcpyDeviceToDevice, s),
                                 "cudaMemcpyAsync(pull rows)");
            if (!err && p.topk_weights != nullptr)
                err = check_cuda(cudaMemcpyAsync(own_weights + int64_t(first) * p.num_topk,
                                                 p.topk_weights + int64_t(first) * p.num_topk,
                                                 size_t(count * p.num_topk * 4), cudaMemcpyDeviceToDevice, s),
                                 "cudaMemcpyAsync(pull weights)");
        }
        if (err) return err;
        barrier_kernel<<<1, 32, 0, s>>>(ctx->dev);
        if (int e = check_launch("barrier_kernel")) return e;
    } else if (ce && (p.num_send_warps != 0 || p.num_send_blocks != 0)) {
        return set_error(-1, "a copy-engine combine has no sender warps (the copy engines carry every row)");
    } else if (!ce && p.num_send_blocks == 0 && p.num_send_warps < 1) {
        return set_error(-1, "combine needs sender warps unless the copy engines carry every row (copy_engine)");
    }
    if (ce) {
        if (int err = check_copy(p.copy_piece_rows, p.copy_streams, p.host_counts)) return err;
        if (int err = check_copy_rows(ctx, p.host_counts, row_bytes + 4 * p.num_topk)) return err;
        if (int err = copy_begin(mut, s, int(p.copy_streams))) return err;
    }
    if (int err = by_dtype(p.dtype, [&](auto t) {
            using T = decltype(t);
            if (R <= 2)
                combine_kernel<T, 2><<<grid, kThreads, 0, s>>>(ctx->dev, p);
            else if (R <= 4)
                combine_kernel<T, 4><<<grid, kThreads, 0, s>>>(ctx->dev, p);
            else
                combine_kernel<T, 8><<<grid, kThreads, 0, s>>>(ctx->dev, p);
            return check_launch("combine_kernel");
        }))
        return err;
    if (!ce) return 0;
    // Rows received from rank d sit together in x (and topk_weights) and go back in the same order: the copy
    // engines ship them as they are, weights first (every copy stream's pieces start after them, so the pieces'
    // flags cover them too).
    const int32_t* counts = p.host_counts;
    auto count = [&](int d) { return int(counts[d * R + me]); };
    auto copied = [&](int d) { return count(d); };
    int64_t first[kMaxRanks];
    for (int d = 0, row = 0; d < R; ++d) {
        first[d] = row;
        row += count(d);
    }
    for (int k = 1; k < R && p.topk_weights != nullptr; ++k) {
        const int d = (me + k) % R;
        if (copied(d) == 0) continue;
        char* dst = ctx->dev.bufs[d] + kStagingOffset + int64_t(me) * ctx->dev.region_bytes + count(d) * row_bytes;
        if (int err = check_cuda(
                cudaMemcpyAsync(dst, p.topk_weights + first[d] * p.num_topk, size_t(copied(d)) * p.num_topk * 4,
                                cudaMemcpyDeviceToDevice, ctx->copy_streams[0]),
                "cudaMemcpyAsync(combine weights)"))
            return err;
    }
    if (p.topk_weights != nullptr)
        if (int err = copy_after_lead(mut, int(p.copy_streams))) return err;
    const char* x = static_cast<const char*>(p.x);
    int err = copy_rows(
        mut, copied, [&](int d) { return x + first[d] * row_bytes; }, row_bytes, p.copy_piece_rows,
        int(p.copy_streams));
    return err ? err : copy_finish(mut, s, int(p.copy_streams));
}

extern "C" int moe_ep_get_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk,
                                          int64_t num_experts, int64_t num_ranks, int32_t* per_rank,
                                          int32_t* per_expert, uint8_t* is_token_in_rank, void* stream) {
    if (num_ranks < 1 || num_ranks > 32 || num_experts % num_ranks != 0 || num_experts > 12288)
        return set_error(-1,
                         "moe_ep_get_dispatch_layout: need num_experts divisible by 1 <= num_ranks <= 32 and "
                         "num_experts <= 12288");
    if (num_tokens == 0) return 0;
    const int blocks =
        int((num_tokens + kLayoutThreads - 1) / kLayoutThreads < 64 ? (num_tokens + kLayoutThreads - 1) / kLayoutThreads
                                                                    : 64);
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
        return set_error(-1,
                         "moe_ep_routing_map_topk: need 1 <= topk <= num_experts and num_tokens * num_experts < 2^31");
    if (num_tokens == 0) return 0;
    const int64_t blocks = (num_tokens + kRoutingThreads / 32 - 1) / (kRoutingThreads / 32);
    routing_map_topk_kernel<<<int(blocks < 1024 ? blocks : 1024), kRoutingThreads, 0,
                              static_cast<cudaStream_t>(stream)>>>(routing_map, probs, int(num_tokens),
                                                                   int(num_experts), int(topk), topk_idx, topk_weights);
    return check_launch("routing_map_topk_kernel");
}

namespace {

// Both expert_slots kernels over one grid (workspace: workspace_blocks * (L + 2) int32).
int launch_expert_slots(const int64_t* topk_idx, int64_t num_entries, int64_t num_topk, int64_t num_local_experts,
                        int64_t alignment, int32_t* recv_slot, int64_t* words, int32_t* workspace,
                        int64_t workspace_blocks, cudaStream_t stream) {
    if (num_entries > INT_MAX) return set_error(-1, "expert_slots: more than INT_MAX (row, top-k) entries");
    const int64_t blocks = std::max<int64_t>(
        1, std::min<int64_t>(ceil_div(num_entries, int64_t(kBlockThreads) * kSlotsBatch), workspace_blocks));
    const int64_t per_warp = std::max<int64_t>(32, ceil_div(ceil_div(num_entries, blocks * kWarpsPerBlock), 32) * 32);
    const size_t smem = expert_slots_smem(int(num_local_experts));
    slot_counts_kernel<<<unsigned(blocks), kBlockThreads, smem, stream>>>(topk_idx, num_entries, int(num_topk),
                                                                          int(num_local_experts), per_warp, workspace);
    if (int err = check_launch("slot_counts_kernel")) return err;
    slot_place_kernel<<<unsigned(blocks), kBlockThreads, smem, stream>>>(
        topk_idx, num_entries, int(num_local_experts), int(alignment), per_warp, recv_slot, workspace, words);
    return check_launch("slot_place_kernel");
}

bool slots_args_ok(int64_t num_rows, int64_t num_topk, int64_t num_experts, int64_t alignment, int64_t blocks) {
    return num_rows >= 0 && num_topk >= 1 && num_experts >= 1 && num_experts <= MOE_EP_PERMUTE_MAX_LOCAL_EXPERTS &&
           alignment >= 1 && alignment <= INT_MAX && blocks >= 1;
}

}  // namespace

extern "C" int moe_ep_expert_slots(const int64_t* topk_idx, int64_t num_recv_rows, int64_t num_topk,
                                   int64_t num_local_experts, int64_t alignment, int32_t* recv_slot, int64_t* words,
                                   int32_t* workspace, int64_t workspace_blocks, void* stream) {
    if (!slots_args_ok(num_recv_rows, num_topk, num_local_experts, alignment, workspace_blocks))
        return set_error(-1, "moe_ep_expert_slots: need num_recv_rows >= 0, num_topk >= 1, 1 <= num_local_experts <= " +
                                 std::to_string(MOE_EP_PERMUTE_MAX_LOCAL_EXPERTS) +
                                 ", alignment >= 1 and workspace_blocks >= 1");
    const int64_t entries = num_recv_rows * num_topk;
    if (entries == 0) return 0;
    return launch_expert_slots(topk_idx, entries, num_topk, num_local_experts, alignment, recv_slot, words, workspace,
                               workspace_blocks, static_cast<cudaStream_t>(stream));
}

extern "C" int moe_ep_permute(const void* x, const int32_t* recv_slot, const float* weights, const float* scales,
                              int64_t num_recv_rows, int64_t num_topk, int64_t row_bytes, int64_t num_scales,
                              int64_t num_rows, void* out_x, float* out_probs, float* out_scales, uint8_t* covered,
                              void* stream) {
    if (num_recv_rows < 0 || num_topk < 1 || num_topk > MOE_EP_PERMUTE_MAX_TOPK || row_bytes < 16 ||
        row_bytes % 16 != 0 || num_scales < 0 || num_rows < 0 || !aligned16(x) || !aligned16(out_x) ||
        (weights == nullptr) != (out_probs == nullptr) || (scales == nullptr) != (out_scales == nullptr))
        return set_error(-1, "moe_ep_permute: need 1 <= num_topk <= " + std::to_string(MOE_EP_PERMUTE_MAX_TOPK) +
                                 ", row_bytes a positive multiple of 16, 16-byte aligned rows, and weights/scales "
                                 "given together with their outputs");
    if (num_rows == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t row_vecs = row_bytes / 16;
    if (int err = check_cuda(cudaMemsetAsync(covered, 0, size_t(num_rows), s), "cudaMemsetAsync(covered)")) return err;
    if (num_recv_rows > 0) {
        static std::atomic<int> cache[kMaxDevices];
        int resident = 0;
        if (int err = resident_blocks(reinterpret_cast<const void*>(permute_kernel), 0, cache, &resident)) return err;
        const int64_t chunks_per_row = ceil_div(row_vecs, kChunkVecs);
        const int64_t blocks = std::min<int64_t>(ceil_div(num_recv_rows * chunks_per_row, kWarpsPerBlock), resident);
        permute_kernel<<<unsigned(blocks), kBlockThreads, 0, s>>>(
            static_cast<const int4*>(x), recv_slot, weights, scales, num_recv_rows, int(num_topk), row_vecs,
            chunks_per_row, num_scales, num_rows, static_cast<int4*>(out_x), out_probs, out_scales, covered);
        if (int err = check_launch("permute_kernel")) return err;
    }
    static std::atomic<int> cache[kMaxDevices];
    int resident = 0;
    if (int err = resident_blocks(reinterpret_cast<const void*>(zero_padding_kernel), 0, cache, &resident)) return err;
    const int64_t blocks = std::min<int64_t>(ceil_div(num_rows, kWarpsPerBlock), resident);
    zero_padding_kernel<<<unsigned(blocks), kBlockThreads, 0, s>>>(covered, num_rows, row_vecs, num_scales,
                                                                   static_cast<int4*>(out_x), out_probs, out_scales);
    return check_launch("zero_padding_kernel");
}

namespace {

template <typename T>
int launch_unpermute(const void* y, const int32_t* recv_slot, int64_t num_recv_rows, int64_t num_topk, int64_t row_vecs,
                     int64_t num_rows, void* out, cudaStream_t stream) {
    static std::atomic<int> cache[kMaxDevices];
    int resident = 0;
    if (int err = resident_blocks(reinterpret_cast<const void*>(unpermute_kernel<T>), 0, cache, &resident)) return err;
    const int64_t chunks_per_row = ceil_div(row_vecs, kChunkVecs);
    const int64_t blocks = std::min<int64_t>(ceil_div(num_recv_rows * chunks_per_row, kWarpsPerBlock), resident);
    unpermute_kernel<T><<<unsigned(blocks), kBlockThreads, 0, stream>>>(
        static_cast<const int4*>(y), recv_slot, num_recv_rows, int(num_topk), row_vecs, chunks_per_row, num_rows,
        static_cast<int4*>(out));
    return check_launch("unpermute_kernel");
}

}  // namespace

extern "C" int moe_ep_unpermute(const void* y, const int32_t* recv_slot, int64_t num_recv_rows, int64_t num_topk,
                                int64_t hidden, int64_t num_rows, int64_t dtype, void* out, void* stream) {
    const int64_t elem_bytes = dtype_bytes(dtype);
    const int64_t row_bytes = hidden * elem_bytes;
    if (elem_bytes == 0 || num_recv_rows < 0 || num_topk < 1 || num_topk > MOE_EP_PERMUTE_MAX_TOPK || row_bytes < 16 ||
        row_bytes % 16 != 0 || num_rows < 0 || !aligned16(y) || !aligned16(out))
        return set_error(-1, "moe_ep_unpermute: need an FP32/BF16/FP16 dtype code, 1 <= num_topk <= " +
                                 std::to_string(MOE_EP_PERMUTE_MAX_TOPK) +
                                 ", rows a positive multiple of 16 bytes and 16-byte aligned pointers");
    if (num_recv_rows == 0) return 0;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t row_vecs = row_bytes / 16;
    return by_dtype(dtype, [&](auto t) {
        return launch_unpermute<decltype(t)>(y, recv_slot, num_recv_rows, num_topk, row_vecs, num_rows, out, s);
    });
}

// Low-latency kernels, host side: shape checks and the buffer set's call sequence.
namespace moe_ep {

static int ll_check(const Context* ctx, const LLShape& s, int64_t set, int64_t topk, int64_t tokens) {
    if (s.E <= 0 || s.E % s.R != 0 || s.E > kMaxExperts)
        return set_error(-1, "low-latency: num_experts must be a positive multiple of the ranks, at most " +
                                 std::to_string(kMaxExperts));
    if (s.H <= 0 || s.H % 128 != 0) return set_error(-1, "low-latency: hidden must be a multiple of 128");
    if (s.M <= 0 || tokens < 0 || tokens > s.M) return set_error(-1, "low-latency: tokens must lie in [0, max_tokens]");
    if (topk < 1 || topk > MOE_EP_MAX_TOPK) return set_error(-1, "low-latency: num_topk out of range");
    if (set != 0 && set != 1) return set_error(-1, "low-latency: buffer_set must be 0 or 1");
    if (kStagingOffset + 2 * s.set_bytes > ctx->bytes)
        return set_error(-1, "low-latency: the buffer holds " + std::to_string(ctx->bytes - kStagingOffset) +
                                 " bytes, these shapes need " + std::to_string(2 * s.set_bytes));
    return 0;
}

static int* ll_seq(const Context* ctx, const LLShape& s, int64_t set) {
    return reinterpret_cast<int*>(static_cast<char*>(ctx->local) + kStagingOffset + set * s.set_bytes);
}

// One call's entry point: the shape from its parameters (dispatch or combine), checked, then
// `launch(ctx, p, shape, stream)`.
template <typename Params, typename Launch>
static int ll_entry(void* handle, const Params* params, void* stream, Launch launch) {
    const Context* ctx = static_cast<const Context*>(handle);
    const LLShape s = ll_shape(params->max_tokens, params->hidden, params->num_experts, ctx->dev.num_ranks);
    if (int err = ll_check(ctx, s, params->buffer_set, params->num_topk, params->num_tokens)) return err;
    return launch(ctx, *params, s, static_cast<cudaStream_t>(stream));
}

static int ll_advance(const Context* ctx, const LLShape& s, int64_t set, cudaStream_t stream) {
    ll_advance_kernel<<<1, 1, 0, stream>>>(ll_seq(ctx, s, set));
    return check_launch("ll_advance_kernel");
}

}  // namespace moe_ep

extern "C" int64_t moe_ep_ll_set_bytes(int64_t max_tokens, int64_t hidden, int64_t num_experts) {
    return ll_shape(max_tokens, hidden, num_experts, 1).set_bytes;
}

extern "C" void* moe_ep_ll_combine_buffer(void* handle, int64_t max_tokens, int64_t hidden, int64_t num_experts,
                                          int64_t buffer_set) {
    const Context* ctx = static_cast<const Context*>(handle);
    const LLShape s = ll_shape(max_tokens, hidden, num_experts, ctx->dev.num_ranks);
    if (ll_check(ctx, s, buffer_set, 1, 0)) return nullptr;
    return static_cast<char*>(ctx->local) + kStagingOffset + buffer_set * s.set_bytes + kLLSignalBytes;
}

extern "C" int moe_ep_ll_dispatch_send(void* handle, const moe_ep_ll_dispatch_params* params, void* stream) {
    return ll_entry(handle, params, stream,
                    [](const Context* ctx, const moe_ep_ll_dispatch_params& p, const LLShape& s, cudaStream_t st) {
                        if (p.num_tokens > 0) {
                            const LLPack pack{p.x, p.num_tokens, p.use_fp8, p.round_scale, p.buffer_set};
                            ll_pack_kernel<<<unsigned((p.num_tokens + 7) / 8), 256, 0, st>>>(ctx->dev, pack, s);
                            if (int err = check_launch("ll_pack_kernel")) return err;
                        }
                        ll::dispatch<<<unsigned(s.E), kLLThreads, 0, st>>>(ctx->dev, p, s, 0);
                        return check_launch("low-latency dispatch (send)");
                    });
}

extern "C" int moe_ep_ll_dispatch_recv(void* handle, const moe_ep_ll_dispatch_params* params, void* stream) {
    return ll_entry(handle, params, stream,
                    [](const Context* ctx, const moe_ep_ll_dispatch_params& p, const LLShape& s, cudaStream_t st) {
                        ll::dispatch<<<unsigned(s.L), kLLThreads, 0, st>>>(ctx->dev, p, s, 1);
                        if (int err = check_launch("low-latency dispatch (receive)")) return err;
                        return ll_advance(ctx, s, p.buffer_set, st);
                    });
}

extern "C" int moe_ep_ll_combine_send(void* handle, const moe_ep_ll_combine_params* params, void* stream) {
    return ll_entry(handle, params, stream,
                    [](const Context* ctx, const moe_ep_ll_combine_params& p, const LLShape& s, cudaStream_t st) {
                        ll::combine<<<unsigned(s.L * s.R), kLLThreads, 0, st>>>(ctx->dev, p, s, 0);
                        return check_launch("low-latency combine (send)");
                    });
}

extern "C" int moe_ep_ll_combine_recv(void* handle, const moe_ep_ll_combine_params* params, void* stream) {
    return ll_entry(handle, params, stream,
                    [](const Context* ctx, const moe_ep_ll_combine_params& p, const LLShape& s, cudaStream_t st) {
                        // at least one block: the receive is also a barrier, with or without tokens
                        ll::combine<<<unsigned(p.num_tokens > 0 ? p.num_tokens : 1), 256, 0, st>>>(ctx->dev, p, s, 1);
                        if (int err = check_launch("low-latency combine (receive)")) return err;
                        return ll_advance(ctx, s, p.buffer_set, st);
                    });
}

extern "C" int moe_ep_ll_clean(void* handle, void* stream) {
    const Context* ctx = static_cast<const Context*>(handle);
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (int err = check_cuda(cudaMemsetAsync(static_cast<char*>(ctx->local) + kStagingOffset, 0,
                                             size_t(ctx->bytes - kStagingOffset), st),
                             "cudaMemsetAsync(low-latency)"))
        return err;
    return moe_ep_barrier(handle, stream);
}
