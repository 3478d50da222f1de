/* Local expert-major permutation kernels (moe_ep_plugin/permute.py binds them with ctypes).
 *
 * Expert-major layout: local expert l owns output rows [base[l], base[l] + aligned[l]) where aligned[l] is the
 * number of (received row, top-k column) pairs naming l, rounded up to `alignment`, and base is the exclusive
 * cumsum of aligned. Inside a block, rows follow received-row order (then top-k column); padding rows end it.
 * recv_slot [N, K] int32 holds the output row of every pair, -1 where the column names no local expert.
 *
 * Plain C ABI like moe_ep.h: raw device pointers, the stream as void*, 0 on success or a nonzero code with a
 * message in moe_ep_last_error(). Nothing here synchronizes with the host.
 */
#ifndef MOE_EP_PERMUTE_H_
#define MOE_EP_PERMUTE_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_EP_PERMUTE_MAX_LOCAL_EXPERTS 1024 /* expert_slots keeps per-warp counters of every local expert */
#define MOE_EP_PERMUTE_MAX_TOPK 32            /* permute/unpermute keep one top-k column per lane of a warp */

#define MOE_EP_PERMUTE_FP32 0
#define MOE_EP_PERMUTE_BF16 1

/* topk_idx [num_recv_rows, num_topk] local expert ids (outside [0, num_local_experts) = none) -> recv_slot.
 * The counts are computed on the device (one cooperative kernel); workspace holds workspace_blocks *
 * num_local_experts int32 (workspace_blocks >= 1; the number of SMs is enough). */
int moe_ep_expert_slots(const int64_t* topk_idx, int64_t num_recv_rows, int64_t num_topk, int64_t num_local_experts,
                        int64_t alignment, int32_t* recv_slot, int32_t* workspace, int64_t workspace_blocks,
                        void* stream);

/* Scatter: every received row of x (row_bytes each; row_bytes and the pointers 16-byte aligned) is read once and
 * stored to each of its slots in out_x [num_rows, row_bytes]; weights [N, K] -> out_probs [num_rows] and scales
 * [N, num_scales] -> out_scales [num_rows, num_scales] the same way (each may be NULL, with its output). Rows no
 * slot names (padding) are zeroed; slots outside [0, num_rows) are ignored. covered: num_rows bytes of scratch. */
int moe_ep_permute(const void* x, const int32_t* recv_slot, const float* weights, const float* scales,
                   int64_t num_recv_rows, int64_t num_topk, int64_t row_bytes, int64_t num_scales, int64_t num_rows,
                   void* out_x, float* out_probs, float* out_scales, uint8_t* covered, void* stream);

/* Gather-sum: out[r] = sum over k ascending of y[recv_slot[r, k]] (slots in [0, num_rows) only), accumulated in
 * fp32 from 0.0f and rounded once to the element type (MOE_EP_PERMUTE_FP32 / _BF16). y [num_rows, hidden],
 * out [num_recv_rows, hidden]; hidden * element bytes and the pointers 16-byte aligned. */
int moe_ep_unpermute(const void* y, const int32_t* recv_slot, int64_t num_recv_rows, int64_t num_topk, int64_t hidden,
                     int64_t num_rows, int64_t dtype, void* out, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EP_PERMUTE_H_ */
