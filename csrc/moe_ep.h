/* moe_ep_plugin kernel library: the plain C ABI that moe_ep_plugin/ops/library.py mirrors with ctypes (the one
 * header of the library; entry points in csrc/api.cu, csrc/runtime.cu and csrc/drop_and_pad.cu).
 *
 * No torch headers: every tensor is a raw device pointer, every stream a cudaStream_t passed as void*.
 * Functions return 0 on success, or a nonzero code with a message in moe_ep_last_error().
 * Peer-memory waits inside kernels time out; what stalled is written to the context's error record
 * (moe_ep_error_info), which Python turns into an exception. A kernel that records a timeout then traps: the
 * process's CUDA context is lost (every later CUDA call fails), so the timed-out call's outputs cannot be read as
 * data; the record, in host memory, stays readable.
 */
#ifndef MOE_EP_H_
#define MOE_EP_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_EP_ABI_VERSION 19
#define MOE_EP_MAX_RANKS 8
#define MOE_EP_MAX_TOPK 32
#define MOE_EP_MAX_EXPERTS 1024   /* experts whose counts notify exchanges (expert-major mode) */
#define MOE_EP_MAX_COPY_STREAMS 4 /* copy-engine combine: streams the pieces alternate between */
#define MOE_EP_META_WORDS 8 /* words describing a dispatch that every rank's must equal (moe_ep_plugin META_FIELDS) */

/* Element types of the rows a kernel sums (combine, unpermute, pad_sum): each sums in fp32 from 0.0f and
 * rounds once to the type (RNE). Kernels that only move rows take their width in bytes instead. */
#define MOE_EP_DTYPE_FP32 0
#define MOE_EP_DTYPE_BF16 1
#define MOE_EP_DTYPE_FP16 2

/* Error record codes (error_info[0]); error_info[1..3] hold the details named here. */
#define MOE_EP_ERR_BARRIER_TIMEOUT 1  /* [1] = peer rank that never arrived */
#define MOE_EP_ERR_DISPATCH_TIMEOUT 2 /* [1] = source rank whose rows never arrived, [2] = chunk */
#define MOE_EP_ERR_COMBINE_TIMEOUT 3  /* [1] = rank whose rows never came back, [2] = chunk */
#define MOE_EP_ERR_WORST_TOKENS 4     /* [1] = rows received, [2] = rows allocated (num_worst_tokens) */
#define MOE_EP_ERR_CAPACITY 5         /* [1] = rows needed in one peer region, [2] = rows it holds */
/* [1] = bit mask of the ranks whose meta words differ from rank 0's, [2] = bit mask of the words that differ */
#define MOE_EP_ERR_MISMATCH 6
/* [1] = bit mask of the ranks that refused the call, [2] = the refusal word of one of them: the refusal code
 * (moe_ep_plugin's refusal_code) | the call << 8 (0: a dispatch, in the last meta word MOE_EP_META_WORDS - 1,
 * checked before MOE_EP_ERR_MISMATCH; 1: a low-latency dispatch, 2: a low-latency combine, their `refusal`). */
#define MOE_EP_ERR_REFUSED 7

/* One dispatch. Rows of `x` (N x hidden, elements of x_elem_bytes) go to every rank listed in send_list.
 * Modes: plain byte copy (wire_fp8 = 0: rows of any type, FP16 as BF16; with fp8_in the FP8 rows carry x_scales
 * along), or BF16/FP32 rows quantized to FP8 1x128 blocks in the send path (wire_fp8 = 1: x_elem_bytes 2 reads BF16,
 * 4 FP32; FP16 rows are not quantized, moe_ep_plugin refuses them), arriving as FP8 + scales with fp8_out, else
 * dequantized back to the input's dtype (fp8_out is ignored without wire_fp8).
 * Expert-major mode (expert_major != 0): instead of local top-k ids, each received (row, k) gets its row in this
 * rank's expert-major layout, send_offset[e] + expert_pos[t, k] (each local expert's block padded to `alignment`
 * rows; notify's info holds their total): recv_slot records it and expert_probs[row] the weight (padding rows get 0);
 * recv_topk_idx, recv_topk_weights and recv_expert_count are unused. */
typedef struct {
    const void* x;
    const float* x_scales;             /* [N, hidden/128] with fp8_in, else NULL */
    const int64_t* topk_idx;           /* [N, K] global expert ids, or NULL (cached layout) */
    const float* topk_weights;         /* [N, K] or NULL */
    const int32_t* rank_prefix_matrix; /* [R, R] inclusive prefix over source ranks, on the device */
    const int32_t* send_list;          /* [R, list_stride]: tokens sent to each rank, in token order */
    void* recv_x;                      /* [num_recv_rows, hidden] */
    float* recv_scales;                /* [num_recv_rows, hidden/128] when FP8 is received, else NULL */
    int64_t* recv_topk_idx;            /* [num_recv_rows, K] local ids, or NULL */
    float* recv_topk_weights;          /* [num_recv_rows, K] or NULL */
    int32_t* recv_src_idx;             /* [num_recv_rows] */
    int32_t* recv_expert_count;        /* [num_local_experts], zeroed by the caller; or NULL */
    int64_t num_tokens, hidden, x_elem_bytes, num_topk, num_local_experts, list_stride, num_recv_rows;
    int64_t wire_fp8, fp8_in, fp8_out, round_scale, num_sms;
    int64_t num_send_warps;  /* of each block's warps, how many send (the rest receive) */
    const int32_t* send_pos; /* [N, R]: position of each token among the rows sent to each rank, -1 if none */
    /* expert-major mode */
    int64_t expert_major;
    const int32_t* expert_pos;  /* [N, K]: index of (t, k) among this rank's entries for expert topk_idx[t, k] */
    const int32_t* send_offset; /* [E]: first row of this rank's entries in expert e's block on its owner */
    const int32_t* expert_info; /* notify's info [3 + 2L] (moe_ep_notify_experts) */
    int32_t* recv_slot;         /* [num_recv_rows, K]: expert-major row of each (received row, k), -1 if none */
    float* expert_probs;        /* [expert-major rows] or NULL */
    int64_t alignment;
    /* speculative_rows != 0: num_recv_rows is the caller's guess, launched before it read the received row count;
     * when more rows arrive, receiving is skipped without an error (the caller dispatches again, all ranks alike) */
    int64_t speculative_rows;
    /* pull != 0: a source whose rows for all peers fit one region stages them in its own region of its own buffer
     * (destinations in rank order) and its peers' receivers load them over NVLink; every rank decides this for
     * every source alike from rank_prefix_matrix. */
    int64_t pull;
} moe_ep_dispatch_params;

/* One combine: rows of `x` (num_recv_rows x hidden, of element type `dtype`, a MOE_EP_DTYPE_* code) return to the
 * ranks they came from and are summed per token in fp32 from bias0 and bias1 (of the same type), rounded once to
 * `dtype`; out is [num_tokens, hidden] of that type. */
typedef struct {
    const void* x;
    const float* topk_weights;         /* [num_recv_rows, K] or NULL */
    const int32_t* rank_prefix_matrix; /* [R, R] */
    const int32_t* send_pos;           /* [num_tokens, R]: row of each token among those sent to r, -1 if none */
    const void* bias0;                 /* [num_tokens, hidden] or NULL */
    const void* bias1;
    void* out;          /* [num_tokens, hidden] */
    float* out_weights; /* [num_tokens, K] or NULL */
    int64_t num_tokens, hidden, dtype, num_topk, num_recv_rows, num_sms, num_send_warps, num_send_blocks;
    /* copy_engine != 0: the context's copy streams ship every row (and its topk_weights) straight from x, in pieces
     * of at least copy_piece_rows rows alternating between copy_streams streams (1..MOE_EP_MAX_COPY_STREAMS); no
     * sender warps (num_send_warps = num_send_blocks = 0): every warp reduces. Needs the count matrix on the host:
     * host_counts[i * R + j] = rows rank i sends to rank j (also for pull). */
    int64_t copy_engine, copy_piece_rows, copy_streams;
    const int32_t* host_counts;
    /* pull != 0: every rank copies the rows of x (and topk_weights) it received from peers into its own region of its
     * buffer (same offsets as in x; host_counts gives them), all ranks meet at a barrier, and every warp of the kernel
     * reduces, loading the peers' rows from their buffers over NVLink (no sender warps, no flags). Needs every rank's
     * num_recv_rows * hidden * element bytes to fit a region below the weights area (moe_ep_pull_rows); all ranks must
     * agree on it. */
    int64_t pull;
    /* x_in_region != 0 (pull only): x is this rank's own region (moe_ep_own_region), already holding all
     * num_recv_rows rows at their offsets in receive order (row i at x + i * hidden * element bytes), so no rows are
     * copied; the caller wrote them there after its start barrier (the expert-major combine's unpermute does) and
     * launches no second one. topk_weights, when given, is still a separate [num_recv_rows, K] array and is still
     * copied into the region's weights area. */
    int64_t x_in_region;
    /* The order each token's copies are summed in, after the biases (DeepEP V2's): by the last top-k slot naming an
     * expert of the copy's rank, ranks named by no slot first (ascending). topk_idx [num_tokens, idx_topk] int64 is
     * the dispatch's (ids outside [0, num_local_experts * R) name no rank), 1 <= idx_topk <= MOE_EP_MAX_TOPK; NULL
     * (a dispatch by layout alone): ascending rank order. */
    const int64_t* topk_idx;
    int64_t idx_topk, num_local_experts;
} moe_ep_combine_params;

/* Rows of `row_bytes` a pull combine with num_topk weights per row can hold in one region. */
int64_t moe_ep_pull_rows(void* ctx, int64_t row_bytes, int64_t num_topk);

int moe_ep_abi_version(void);
const char* moe_ep_last_error(void);

/* Context: one peer-visible buffer per rank (cudaMalloc, shared by CUDA IPC), a host-mapped error record, and a
 * copy stream with the events that fork it from / join it to the caller's stream (copy-engine combine). */
void* moe_ep_create(int rank, int num_ranks, int device, int64_t buffer_bytes, int64_t timeout_ns);
int moe_ep_ipc_handle(void* ctx, void* out_handle /* 64 bytes */);
int moe_ep_open_peers(void* ctx, const void* handles /* num_ranks * 64 bytes, rank order */);
int moe_ep_destroy(void* ctx);
volatile int32_t* moe_ep_error_info(void* ctx); /* host pointer to int32[4]; [0] == 0 while healthy */
int64_t moe_ep_region_bytes(void* ctx);         /* staging bytes reserved for each source rank */
int64_t moe_ep_staging_offset(void);            /* buffer bytes before the staging regions (header, counts, flags) */
/* This rank's own region of its buffer (4096-byte aligned): where a pull combine's rows sit (x_in_region). */
void* moe_ep_own_region(void* ctx);
/* This rank's region of peer `peer`'s buffer, as this rank has it mapped (CUDA IPC): where its rows land there.
 * The SM sweep's copy kernel writes through it, the mapping the kernels use. NULL for an unopened peer. */
void* moe_ep_peer_region(void* ctx, int peer);

/* Host read of up to MOE_EP_READ_BYTES of device memory, started after the work enqueued on `stream` so far and
 * copied on a side stream, so the caller can enqueue more before it waits; moe_ep_read_wait blocks until the
 * values are in moe_ep_read_buffer (pinned host memory, valid until the next read). */
#define MOE_EP_READ_BYTES 16384
int moe_ep_read_start(void* ctx, const void* src, int64_t bytes, void* stream);
int moe_ep_read_wait(void* ctx);
const int32_t* moe_ep_read_buffer(void* ctx);

/* topk_idx [N, K] -> per-rank token counts (a token counts once per rank), per-expert counts, is_token_in_rank
 * [N, R] (bytes 0/1). per_rank and per_expert must be zeroed by the caller. */
int moe_ep_get_dispatch_layout(const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                               int64_t num_ranks, int32_t* per_rank, int32_t* per_expert, uint8_t* is_token_in_rank,
                               void* stream);

/* Multi-hot routing map [N, E] (bytes 0/1) and float32 probs [N, E] -> each token's selected experts in ascending
 * order as topk_idx [N, K] int64 with their probs in topk_weights [N, K] (-1 / 0 past a token's selected experts;
 * selected experts past the K-th are ignored). Megatron-Core's routing_map / probs pair to DeepEP's top-k form. */
int moe_ep_routing_map_topk(const uint8_t* routing_map, const float* probs, int64_t num_tokens, int64_t num_experts,
                            int64_t topk, int64_t* topk_idx, float* topk_weights, void* stream);

/* Barrier with every peer; with num_tokens_per_rank given, also exchanges counts into rank_prefix_matrix [R, R]
 * and every rank's count of out-of-range expert ids (num_invalid, one int32), and writes info[0] = rows this rank
 * receives, info[1] = bit mask of the ranks that found out-of-range ids. `meta` (host memory, MOE_EP_META_WORDS
 * words, or NULL) rides along: when any rank's differs, every rank records MOE_EP_ERR_MISMATCH (and the dispatch
 * that follows does nothing). With num_tokens_per_expert [E] (device, E = num_experts <= MOE_EP_MAX_EXPERTS, a
 * dispatch without top-k) those counts are exchanged too: info[2 + l] = entries every rank sends to local expert
 * l (L = E / R). Always writes send_pos [N, R] and send_list [R, list_stride] from is_token_in_rank. */
int moe_ep_notify_dispatch(void* ctx, const int32_t* num_tokens_per_rank, const int32_t* num_invalid,
                           const uint8_t* is_token_in_rank, int64_t num_tokens, int64_t list_stride,
                           int32_t* rank_prefix_matrix, int32_t* send_pos, int32_t* send_list, int32_t* info,
                           const int32_t* meta, const int32_t* num_tokens_per_expert, int64_t num_experts,
                           void* stream);

/* The notify of an expert-major dispatch, straight from top-k ids [N, K] (no layout step): the same barrier, count
 * exchange, rank_prefix_matrix, send_pos and send_list, plus is_token_in_rank [N, R] (bytes), expert_pos [N, K]
 * (each entry's index among this rank's entries for its expert, -1 for none), send_offset [E] (see
 * moe_ep_dispatch_params) and info [4 + 2L] = {rows this rank receives, out-of-range-id rank mask, M = its
 * expert-major rows, per local expert the row count rounded up to `alignment`, then the exact count, then the most
 * expert-major rows any rank has (every rank computes the same)}; `meta` as in moe_ep_notify_dispatch. */
int moe_ep_notify_experts(void* ctx, const int64_t* topk_idx, int64_t num_tokens, int64_t num_topk, int64_t num_experts,
                          int64_t alignment, int64_t list_stride, int32_t* rank_prefix_matrix, int32_t* send_pos,
                          int32_t* send_list, uint8_t* is_token_in_rank, int32_t* expert_pos, int32_t* send_offset,
                          int32_t* info, const int32_t* meta, void* stream);
int moe_ep_barrier(void* ctx, void* stream);
int moe_ep_dispatch(void* ctx, const moe_ep_dispatch_params* params, void* stream);
int moe_ep_combine(void* ctx, const moe_ep_combine_params* params, void* stream);

/* Local expert-major permutation. Expert-major layout: local expert l owns output rows [base[l], base[l] +
 * aligned[l]) where aligned[l] is the number of (received row, top-k column) pairs naming l, rounded up to
 * `alignment`, and base is the exclusive cumsum of aligned. Inside a block, rows follow received-row order (then
 * top-k column); padding rows end it. recv_slot [N, K] int32 holds the output row of every pair, -1 where the
 * column names no local expert. Nothing here synchronizes with the host. */
#define MOE_EP_PERMUTE_MAX_LOCAL_EXPERTS 1024 /* expert_slots keeps per-warp counters of every local expert */
#define MOE_EP_PERMUTE_MAX_TOPK 32            /* permute/unpermute keep one top-k column per lane of a warp */

/* topk_idx [num_recv_rows, num_topk] local expert ids (outside [0, num_local_experts) = none) -> recv_slot, and
 * (unless NULL) words [2 + num_local_experts] int64: rows naming a local expert, ids outside [-1, num_local_experts),
 * then the pairs of each local expert rounded up to alignment (not written when num_recv_rows is 0).
 * The counts are computed on the device (two kernels); workspace holds workspace_blocks * (num_local_experts + 2)
 * int32 (workspace_blocks >= 1; the number of SMs is enough). */
int moe_ep_expert_slots(const int64_t* topk_idx, int64_t num_recv_rows, int64_t num_topk, int64_t num_local_experts,
                        int64_t alignment, int32_t* recv_slot, int64_t* words, int32_t* workspace,
                        int64_t workspace_blocks, void* stream);

/* Scatter: every received row of x (row_bytes each; row_bytes and the pointers 16-byte aligned) is read once and
 * stored to each of its slots in out_x [num_rows, row_bytes]; weights [N, K] -> out_probs [num_rows] and scales
 * [N, num_scales] -> out_scales [num_rows, num_scales] the same way (each may be NULL, with its output). Rows no
 * slot names (padding) are zeroed; slots outside [0, num_rows) are ignored. covered: num_rows bytes of scratch. */
int moe_ep_permute(const void* x, const int32_t* recv_slot, const float* weights, const float* scales,
                   int64_t num_recv_rows, int64_t num_topk, int64_t row_bytes, int64_t num_scales, int64_t num_rows,
                   void* out_x, float* out_probs, float* out_scales, uint8_t* covered, void* stream);

/* Gather-sum: out[r] = sum over k ascending of y[recv_slot[r, k]] (slots in [0, num_rows) only), accumulated in
 * fp32 from 0.0f and rounded once to the element type (MOE_EP_DTYPE_*). y [num_rows, hidden],
 * out [num_recv_rows, hidden]; hidden * element bytes and the pointers 16-byte aligned. */
int moe_ep_unpermute(const void* y, const int32_t* recv_slot, int64_t num_recv_rows, int64_t num_topk, int64_t hidden,
                     int64_t num_rows, int64_t dtype, void* out, void* stream);

/* Drop-and-pad (drop_and_pad.cu): every expert takes exactly `capacity` (C) tokens, so all rows are fixed by it.
 * Pair p = e * C + c is expert e's c-th token. Nothing here synchronizes with the host. */
#define MOE_EP_PAD_MAX_SLOTS 12288 /* pad_sum keeps a token's valid slots in shared memory */

/* routing_map [num_tokens, num_experts] bool (bytes) -> expert e's C tokens: its marked tokens in token order, then
 * the unmarked ones (a stable descending sort of column e), the first C taken. tokens [E * C] int64 the token of
 * each pair, experts [E * C] int64 its expert, slot [num_tokens, E] int32 each (token, expert)'s pair, -1 where the
 * expert does not take the token. One launch, one block per expert. */
int moe_ep_pad_select(const uint8_t* routing_map, int64_t num_tokens, int64_t num_experts, int64_t capacity,
                      int64_t* tokens, int64_t* experts, int32_t* slot, void* stream);

/* Row moves between the pair order [G * L * C] (source group g, expert l of L, token c) and the expert-major order
 * [L * block] (expert l's G * C rows by group, then zero rows to `block`), rows of row_bytes (a multiple of 16, the
 * pointers 16-byte aligned; any element type). inverse = 0: out [L * block] from the pair rows of `in`, read
 * through tokens[q] (int64, G = 1: rows of a [num_in] token tensor) when given; probs (or NULL, with out_probs)
 * [num_in, G * L] float32 through tokens, else [num_in], land in out_probs [L * block] (0 on padding). inverse = 1
 * (no tokens): out [G * L * C] pair rows from the expert-major rows of `in`, probs [num_in] alike. Source rows
 * outside [0, num_in) read as zero. One launch. */
int moe_ep_pad_arrange(const void* in, const int64_t* tokens, const float* probs, int64_t num_in, int64_t row_bytes,
                       int64_t groups, int64_t local, int64_t capacity, int64_t block, int64_t inverse, void* out,
                       float* out_probs, void* stream);

/* out[t] = sum over k ascending of y[row(slot[t, k])], in fp32 from 0.0f, rounded once to the element type
 * (MOE_EP_DTYPE_*), where pair p's row is (p / capacity) * block + p % capacity (block >= capacity: the
 * pairs' rows in blocks of `block` per expert) and pairs < 0 or with a row past num_y_rows add nothing; slot
 * [num_tokens, num_slots] int32, y [num_y_rows, hidden], out [num_tokens, hidden]; hidden * element bytes and the
 * pointers 16-byte aligned. weights (or NULL, with out_weights) [num_y_rows] float32: out_weights[t, k] = 0.0f +
 * weights[row], 0 for an invalid pair. One launch, one block per (token, 256 vectors of its row). */
int moe_ep_pad_sum(const void* y, const int32_t* slot, const float* weights, int64_t num_tokens, int64_t num_slots,
                   int64_t capacity, int64_t block, int64_t num_y_rows, int64_t hidden, int64_t dtype, void* out,
                   float* out_weights, void* stream);

/* Low-latency mode (low_latency.cu), DeepEP V1's decode kernels on CUDA-IPC peer memory. A context made for it
 * holds, after moe_ep_staging_offset() bytes, two alternating buffer sets (moe_ep_ll_set_bytes each): per set a
 * signal page (the set's call sequence, the mask of ranks that refused a call and a refusal word, then per (local
 * expert, source rank) a row count and a flag, per global
 * expert a combine flag), fixed dispatch slots [local expert][source rank][M] of 16 + 2*hidden bytes (a header
 * holding the source token, then the BF16 row or the FP8 row and its float32 scales), and combine slots
 * [global expert][M] of BF16 rows, which also stage this rank's packed rows during a dispatch. Rows of one
 * (expert, source) are placed in source-token order, so outputs are deterministic. Flags carry the set's call
 * sequence (kept on the device, advanced by the receive half), so nothing is reset between calls and CUDA-graph
 * replays stay correct. Every call is two launches on `stream` with no host sync: the send half
 * (moe_ep_ll_*_send) and the receive half (moe_ep_ll_*_recv, what DeepEP's hook runs); receive waits time out
 * into the error record (MOE_EP_ERR_DISPATCH_TIMEOUT [1] = source rank, [2] = local expert;
 * MOE_EP_ERR_COMBINE_TIMEOUT [1] = expert rank, [2] = global expert). All ranks make the same sequence of calls. */
typedef struct {
    const void* x;           /* [N, hidden] BF16 */
    const int64_t* topk_idx; /* [N, K] global expert ids, -1 = none (a repeated id sends one row) */
    void* recv_x;            /* [L, R*M, hidden] BF16, or FP8 e4m3 with use_fp8 */
    void* recv_scales;       /* use_fp8: float32 [L, hidden/128, R*M], or with use_ue8m0 int32 [L, hidden/512,
                                     * R*M] (four exponent bytes, lowest block lowest); else NULL */
    int32_t* recv_count;     /* [L] */
    int32_t* src_info;       /* [L, R*M] source token of each row */
    int64_t* layout_range;   /* [L, R] begin << 32 | count */
    int64_t* wait_stats;     /* [R] or NULL: += ns the receive half waited for each source */
    int64_t num_tokens, hidden, num_topk, num_experts, max_tokens, use_fp8, round_scale, use_ue8m0, buffer_set;
    /* Non-zero: this rank refused the call (the refusal word of MOE_EP_ERR_REFUSED). It takes part without data
     * (num_tokens 0; the pointers may be NULL, nothing is written): its send half marks it refused in every
     * peer's set before the flags, and every rank's receive half then records MOE_EP_ERR_REFUSED. */
    int64_t refusal;
} moe_ep_ll_dispatch_params;

typedef struct {
    const void* x;               /* [L, R*M, hidden] BF16 expert outputs in the dispatch's layout */
    const int64_t* topk_idx;     /* [N, K] as given to the dispatch */
    const float* topk_weights;   /* [N, K] */
    const int32_t* src_info;     /* the dispatch's */
    const int64_t* layout_range; /* the dispatch's */
    void* out;                   /* [N, hidden] BF16: sum over k ascending of weight * row, fp32, rounded once */
    int64_t* wait_stats;         /* [R] or NULL */
    int64_t num_tokens, hidden, num_topk, num_experts, max_tokens, buffer_set;
    int64_t refusal; /* as the dispatch's: this rank refused the combine (num_tokens 0, the pointers may be NULL) */
} moe_ep_ll_combine_params;

int64_t moe_ep_ll_set_bytes(int64_t max_tokens, int64_t hidden, int64_t num_experts);
/* BF16 [L, R*M, hidden] view of buffer set `buffer_set`'s dispatch slots: a zero-copy combine's input. */
void* moe_ep_ll_combine_buffer(void* ctx, int64_t max_tokens, int64_t hidden, int64_t num_experts, int64_t buffer_set);
int moe_ep_ll_dispatch_send(void* ctx, const moe_ep_ll_dispatch_params* params, void* stream);
int moe_ep_ll_dispatch_recv(void* ctx, const moe_ep_ll_dispatch_params* params, void* stream);
int moe_ep_ll_combine_send(void* ctx, const moe_ep_ll_combine_params* params, void* stream);
int moe_ep_ll_combine_recv(void* ctx, const moe_ep_ll_combine_params* params, void* stream);
/* Zero both sets (sequences included), then a barrier with every peer. */
int moe_ep_ll_clean(void* ctx, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EP_H_ */
