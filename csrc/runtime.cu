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

int check_launch(const char* what) {
    return check_cuda(cudaGetLastError(), what);
}

// The driver's cuStreamWriteValue32 (CUresult is an int-sized enum; flags 0 = a plain write with its memory
// barrier, which orders the copy before the flag).
using StreamValueFn = int (*)(cudaStream_t, unsigned long long, unsigned int, unsigned int);

static int driver_entry(const char* symbol, void** fn) {
    cudaDriverEntryPointQueryResult found;
    int err = check_cuda(cudaGetDriverEntryPointByVersion(symbol, fn, 12000, cudaEnableDefault, &found), symbol);
    if (!err && (found != cudaDriverEntryPointSuccess || *fn == nullptr))
        err = set_error(-1, std::string("the CUDA driver has no ") + symbol);
    return err;
}

static int check_driver(int result, const char* what) {
    return result == 0 ? 0 : set_error(result, std::string(what) + " failed with CUresult " + std::to_string(result));
}

int copy_begin(Context* ctx, cudaStream_t stream, int n) {
    int err = check_cuda(cudaEventRecord(ctx->fork, stream), "cudaEventRecord(fork)");
    for (int i = 0; i < n && !err; ++i)
        err = check_cuda(cudaStreamWaitEvent(ctx->copy_streams[i], ctx->fork, 0), "cudaStreamWaitEvent(fork)");
    return err;
}

int copy_piece(Context* ctx, int i, void* dst, const void* src, size_t bytes, int* peer_flag) {
    cudaStream_t s = ctx->copy_streams[i];
    if (int err =
            check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync(peer piece)"))
        return err;
    const int r =
        reinterpret_cast<StreamValueFn>(ctx->write_value32)(s, reinterpret_cast<unsigned long long>(peer_flag), 1u, 0u);
    return check_driver(r, "cuStreamWriteValue32");
}

int copy_after_lead(Context* ctx, int n) {
    int err = check_cuda(cudaEventRecord(ctx->lead, ctx->copy_streams[0]), "cudaEventRecord(lead)");
    for (int i = 1; i < n && !err; ++i)
        err = check_cuda(cudaStreamWaitEvent(ctx->copy_streams[i], ctx->lead, 0), "cudaStreamWaitEvent(lead)");
    return err;
}

int copy_finish(Context* ctx, cudaStream_t stream, int n) {
    int err = 0;
    for (int i = 0; i < n && !err; ++i) {
        err = check_cuda(cudaEventRecord(ctx->joins[i], ctx->copy_streams[i]), "cudaEventRecord(join)");
        if (!err) err = check_cuda(cudaStreamWaitEvent(stream, ctx->joins[i], 0), "cudaStreamWaitEvent(join)");
    }
    if (!err)
        err =
            check_cuda(cudaMemsetAsync(static_cast<char*>(ctx->local) + kCopyFlagsOffset, 0, sizeof(CopyFlags), stream),
                       "cudaMemsetAsync(copy flags)");
    return err;
}

}  // namespace moe_ep

using namespace moe_ep;

extern "C" {

int moe_ep_abi_version(void) {
    return MOE_EP_ABI_VERSION;
}

const char* moe_ep_last_error(void) {
    return g_last_error.c_str();
}

void* moe_ep_create(int rank, int num_ranks, int device, int64_t buffer_bytes, int64_t timeout_ns) {
    if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
        set_error(-1,
                  "moe_ep_create: need 1 <= num_ranks <= " + std::to_string(kMaxRanks) + " and 0 <= rank < num_ranks");
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
    if (!err)
        err =
            check_cuda(cudaHostAlloc(&record, 4 * sizeof(int32_t), cudaHostAllocMapped), "cudaHostAlloc(error record)");
    if (!err) {
        ctx->host_err = static_cast<volatile int32_t*>(record);
        std::memset(const_cast<int32_t*>(ctx->host_err), 0, 4 * sizeof(int32_t));
        err = check_cuda(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ctx->dev.host_err),
                                                  const_cast<int32_t*>(ctx->host_err), 0),
                         "cudaHostGetDevicePointer");
    }
    if (!err) err = check_cuda(cudaEventCreateWithFlags(&ctx->fork, cudaEventDisableTiming), "cudaEventCreate(fork)");
    if (!err) err = check_cuda(cudaEventCreateWithFlags(&ctx->lead, cudaEventDisableTiming), "cudaEventCreate(lead)");
    for (int i = 0; i < MOE_EP_MAX_COPY_STREAMS && !err; ++i) {
        err = check_cuda(cudaStreamCreateWithFlags(&ctx->copy_streams[i], cudaStreamNonBlocking),
                         "cudaStreamCreate(copy)");
        if (!err)
            err = check_cuda(cudaEventCreateWithFlags(&ctx->joins[i], cudaEventDisableTiming), "cudaEventCreate(join)");
    }
    if (!err)
        err = check_cuda(cudaStreamCreateWithFlags(&ctx->read_stream, cudaStreamNonBlocking), "cudaStreamCreate(read)");
    if (!err)
        err = check_cuda(cudaEventCreateWithFlags(&ctx->read_ready, cudaEventDisableTiming), "cudaEventCreate(read)");
    if (!err)
        err = check_cuda(cudaEventCreateWithFlags(&ctx->read_done, cudaEventDisableTiming), "cudaEventCreate(read)");
    if (!err)
        err = check_cuda(
            cudaHostAlloc(reinterpret_cast<void**>(&ctx->read_host), MOE_EP_READ_BYTES, cudaHostAllocDefault),
            "cudaHostAlloc(read buffer)");
    if (!err) err = driver_entry("cuStreamWriteValue32", &ctx->write_value32);
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
    for (int i = 0; i < MOE_EP_MAX_COPY_STREAMS; ++i) {
        if (ctx->copy_streams[i] != nullptr)
            err = err ? err : check_cuda(cudaStreamDestroy(ctx->copy_streams[i]), "cudaStreamDestroy");
        if (ctx->joins[i] != nullptr) err = err ? err : check_cuda(cudaEventDestroy(ctx->joins[i]), "cudaEventDestroy");
    }
    if (ctx->read_stream != nullptr)
        err = err ? err : check_cuda(cudaStreamDestroy(ctx->read_stream), "cudaStreamDestroy");
    if (ctx->read_ready != nullptr) err = err ? err : check_cuda(cudaEventDestroy(ctx->read_ready), "cudaEventDestroy");
    if (ctx->read_done != nullptr) err = err ? err : check_cuda(cudaEventDestroy(ctx->read_done), "cudaEventDestroy");
    if (ctx->read_host != nullptr)
        err = err ? err : check_cuda(cudaFreeHost(ctx->read_host), "cudaFreeHost(read buffer)");
    if (ctx->fork != nullptr) err = err ? err : check_cuda(cudaEventDestroy(ctx->fork), "cudaEventDestroy");
    if (ctx->lead != nullptr) err = err ? err : check_cuda(cudaEventDestroy(ctx->lead), "cudaEventDestroy");
    if (ctx->local != nullptr) err = err ? err : check_cuda(cudaFree(ctx->local), "cudaFree(peer buffer)");
    if (ctx->host_err != nullptr)
        err = err ? err : check_cuda(cudaFreeHost(const_cast<int32_t*>(ctx->host_err)), "cudaFreeHost");
    delete ctx;
    return err;
}

volatile int32_t* moe_ep_error_info(void* handle) {
    return static_cast<Context*>(handle)->host_err;
}

int64_t moe_ep_region_bytes(void* handle) {
    return static_cast<Context*>(handle)->dev.region_bytes;
}

int64_t moe_ep_staging_offset(void) {
    return kStagingOffset;
}

void* moe_ep_own_region(void* handle) {
    const Context* ctx = static_cast<const Context*>(handle);
    return ctx->dev.bufs[ctx->dev.rank] + kStagingOffset + int64_t(ctx->dev.rank) * ctx->dev.region_bytes;
}

void* moe_ep_peer_region(void* handle, int peer) {
    const Context* ctx = static_cast<const Context*>(handle);
    if (peer < 0 || peer >= ctx->dev.num_ranks || ctx->dev.bufs[peer] == nullptr) return nullptr;
    return ctx->dev.bufs[peer] + kStagingOffset + int64_t(ctx->dev.rank) * ctx->dev.region_bytes;
}

int moe_ep_read_start(void* handle, const void* src, int64_t bytes, void* stream) {
    Context* ctx = static_cast<Context*>(handle);
    if (bytes < 0 || bytes > MOE_EP_READ_BYTES)
        return set_error(-1, "moe_ep_read_start: " + std::to_string(bytes) + " bytes (at most " +
                                 std::to_string(MOE_EP_READ_BYTES) + ")");
    int err = check_cuda(cudaEventRecord(ctx->read_ready, static_cast<cudaStream_t>(stream)), "cudaEventRecord(read)");
    if (!err) err = check_cuda(cudaStreamWaitEvent(ctx->read_stream, ctx->read_ready, 0), "cudaStreamWaitEvent(read)");
    if (!err)
        err = check_cuda(cudaMemcpyAsync(ctx->read_host, src, size_t(bytes), cudaMemcpyDeviceToHost, ctx->read_stream),
                         "cudaMemcpyAsync(read)");
    if (!err) err = check_cuda(cudaEventRecord(ctx->read_done, ctx->read_stream), "cudaEventRecord(read done)");
    return err;
}

int moe_ep_read_wait(void* handle) {
    return check_cuda(cudaEventSynchronize(static_cast<Context*>(handle)->read_done), "cudaEventSynchronize(read)");
}

const int32_t* moe_ep_read_buffer(void* handle) {
    return static_cast<Context*>(handle)->read_host;
}

}  // extern "C"
