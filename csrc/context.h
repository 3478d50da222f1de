// Host-side context shared by runtime.cu (lifetime) and the kernel launchers.
#pragma once

#include <string>

#include "common.cuh"

namespace moe_ep {

struct Context {
    DevCtx dev;             // what kernels see (peer pointers, error record, sizes)
    void* local = nullptr;  // this rank's cudaMalloc'd buffer
    volatile int32_t* host_err = nullptr;
    int64_t bytes = 0;
    int device = 0;
    // copy-engine combine: the streams that ship rows (pieces alternate between them, so one stream's per-copy
    // start and flag latency hides behind another's copy), fork/join events, and the driver's stream memory write
    // (fetched at create time; the runtime API has no wrapper for it)
    cudaStream_t copy_streams[MOE_EP_MAX_COPY_STREAMS] = {};
    cudaEvent_t fork = nullptr, lead = nullptr, joins[MOE_EP_MAX_COPY_STREAMS] = {};
    void* write_value32 = nullptr;
    // host reads of small results (notify's counts): a side stream, its events and pinned memory
    cudaStream_t read_stream = nullptr;
    cudaEvent_t read_ready = nullptr, read_done = nullptr;
    int32_t* read_host = nullptr;
};

// Copy-engine pipeline on the first n copy streams, forked from `stream` (after its barrier) and joined back by
// copy_finish. copy_piece on copy stream i: copy `bytes` to the peer, then set *peer_flag = 1 there (the copy's
// bytes land first).
int copy_begin(Context* ctx, cudaStream_t stream, int n);
int copy_piece(Context* ctx, int i, void* dst, const void* src, size_t bytes, int* peer_flag);
// Copy streams 1..n-1 wait for everything enqueued on copy stream 0 so far (a prologue every piece needs).
int copy_after_lead(Context* ctx, int n);
// Joins the first n copy streams back into `stream` and clears this rank's CopyFlags (every piece was consumed).
int copy_finish(Context* ctx, cudaStream_t stream, int n);

// Record `what` as the last error; returns a nonzero code.
int set_error(int code, const std::string& what);
int check_cuda(cudaError_t err, const char* what);
int check_launch(const char* what);

}  // namespace moe_ep
