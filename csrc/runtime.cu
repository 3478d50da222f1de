// Context lifetime: the peer-visible buffer (cudaMalloc + CUDA IPC), the host-mapped error record, and the
// last-error string of the C ABI.
#include <cstdio>
#include <cstring>
#include <string>

#include "common.cuh"
#include "context.h"

namespace moe_ep {

static thread_local std::string g_last_error;

int set_error(int code, const std::string& what) {
    g_last_error = what;
    return code == 0 ? -1 : code;
}

int check_cuda(cudaError_t err, const char* what) {
    if (err == cudaSuccess) return 0;
    return set_error(int(err), std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

int check_launch(const char* what) { return check_cuda(cudaGetLastError(), what); }

}  // namespace moe_ep

using namespace moe_ep;

extern "C" {

int moe_ep_abi_version(void) { return MOE_EP_ABI_VERSION; }

const char* moe_ep_last_error(void) { return g_last_error.c_str(); }

void* moe_ep_create(int rank, int num_ranks, int device, int64_t buffer_bytes, int64_t timeout_ns) {
    if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
        set_error(-1, "moe_ep_create: need 1 <= num_ranks <= " + std::to_string(kMaxRanks) + " and 0 <= rank < num_ranks");
        return nullptr;
    }
    if (buffer_bytes < kStagingOffset + num_ranks * int64_t(1 << 20)) {
        set_error(-1, "moe_ep_create: buffer_bytes too small: " + std::to_string(buffer_bytes));
        return nullptr;
    }
    Context* ctx = new Context();
    std::memset(&ctx->dev, 0, sizeof(ctx->dev));
    ctx->device = device;
    ctx->dev.rank = rank;
    ctx->dev.num_ranks = num_ranks;
    ctx->dev.timeout_ns = timeout_ns;
    ctx->dev.region_bytes = ((buffer_bytes - kStagingOffset) / num_ranks) / 4096 * 4096;
    ctx->bytes = kStagingOffset + ctx->dev.region_bytes * num_ranks;
    int err = check_cuda(cudaSetDevice(device), "cudaSetDevice");
    if (!err) err = check_cuda(cudaMalloc(&ctx->local, size_t(ctx->bytes)), "cudaMalloc(peer buffer)");
    if (!err) err = check_cuda(cudaMemset(ctx->local, 0, size_t(kStagingOffset)), "cudaMemset(peer buffer header)");
    void* record = nullptr;
    if (!err) err = check_cuda(cudaHostAlloc(&record, 4 * sizeof(int32_t), cudaHostAllocMapped),
                               "cudaHostAlloc(error record)");
    if (!err) {
        ctx->host_err = static_cast<volatile int32_t*>(record);
        std::memset(const_cast<int32_t*>(ctx->host_err), 0, 4 * sizeof(int32_t));
        err = check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ctx->dev.host_err),
                                                  const_cast<int32_t*>(ctx->host_err), 0), "cudaHostGetDevicePointer");
    }
    if (!err) err = check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize(create)");
    if (err) {
        moe_ep_destroy(ctx);
        return nullptr;
    }
    ctx->dev.bufs[rank] = static_cast<char*>(ctx->local);
    return ctx;
}

int moe_ep_ipc_handle(void* handle, void* out_handle) {
    Context* ctx = static_cast<Context*>(handle);
    cudaIpcMemHandle_t h;
    int err = check_cuda(cudaIpcGetMemHandle(&h, ctx->local), "cudaIpcGetMemHandle");
    if (!err) std::memcpy(out_handle, &h, sizeof(h));
    return err;
}

int moe_ep_open_peers(void* handle, const void* handles) {
    static_assert(sizeof(cudaIpcMemHandle_t) == 64, "IPC handles are 64 bytes");
    Context* ctx = static_cast<Context*>(handle);
    int err = check_cuda(cudaSetDevice(ctx->device), "cudaSetDevice");
    for (int r = 0; r < ctx->dev.num_ranks && !err; ++r) {
        if (r == ctx->dev.rank || ctx->dev.bufs[r] != nullptr) continue;
        cudaIpcMemHandle_t h;
        std::memcpy(&h, static_cast<const char*>(handles) + 64 * r, sizeof(h));
        void* ptr = nullptr;
        err = check_cuda(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                         ("cudaIpcOpenMemHandle(rank " + std::to_string(r) + ")").c_str());
        if (!err) ctx->dev.bufs[r] = static_cast<char*>(ptr);
    }
    return err;
}

int moe_ep_destroy(void* handle) {
    Context* ctx = static_cast<Context*>(handle);
    if (ctx == nullptr) return 0;
    int err = 0;
    cudaSetDevice(ctx->device);
    cudaDeviceSynchronize();
    for (int r = 0; r < ctx->dev.num_ranks; ++r) {
        if (r != ctx->dev.rank && ctx->dev.bufs[r] != nullptr) {
            err = err ? err : check_cuda(cudaIpcCloseMemHandle(ctx->dev.bufs[r]), "cudaIpcCloseMemHandle");
        }
    }
    if (ctx->local != nullptr) err = err ? err : check_cuda(cudaFree(ctx->local), "cudaFree(peer buffer)");
    if (ctx->host_err != nullptr) err = err ? err : check_cuda(cudaFreeHost(const_cast<int32_t*>(ctx->host_err)), "cudaFreeHost");
    delete ctx;
    return err;
}

volatile int32_t* moe_ep_error_info(void* handle) { return static_cast<Context*>(handle)->host_err; }

int64_t moe_ep_region_bytes(void* handle) { return static_cast<Context*>(handle)->dev.region_bytes; }

}  // extern "C"
