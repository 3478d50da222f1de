// NVLink ceilings between GPU 0 and GPU 1 of this host, one process driving both: how fast bytes cross in one
// direction and in both at once, by SM stores to peer memory (push), SM loads from peer memory (pull) and copy
// engines (cudaMemcpyPeerAsync issued on the source or the target GPU), with a given number of SMs. These bound
// what dispatch/combine can reach (both directions are busy in an EP2 all-to-all). Prints a table.
//   nvcc -O3 -arch=sm_90 benchmarks/nvlink_ceiling.cu -o nvlink_ceiling && ./nvlink_ceiling [MB per direction, default 57]
// Built with -DNVLINK_CEILING_LIBRARY -shared it is the copy yardstick of benchmarks/sm_sweep.py instead (no main):
// nvlink_copy (the copy kernel on `sms` SMs) and nvlink_copy_engine (cudaMemcpyAsync), both on a given stream.
#include <cuda_runtime.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#define CHECK(call)                                                                                 \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) {                                                                    \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            std::exit(1);                                                                           \
        }                                                                                           \
    } while (0)

// Every warp copies 16-byte vectors with 8 loads in flight per lane; dst or src is peer memory.
__global__ void __launch_bounds__(512, 1) copy_kernel(int4* __restrict__ dst, const int4* __restrict__ src, size_t n) {
    const size_t lane = threadIdx.x & 31;
    const size_t warp = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
    const size_t warps = (size_t(gridDim.x) * blockDim.x) >> 5;
    constexpr int kBatch = 8;
    for (size_t base = warp * 32 * kBatch; base < n; base += warps * 32 * kBatch) {
        int4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (base + lane + 32 * u < n) v[u] = src[base + lane + 32 * u];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (base + lane + 32 * u < n) dst[base + lane + 32 * u] = v[u];
    }
}

#ifdef NVLINK_CEILING_LIBRARY
// `bytes` (a multiple of 16) from src to dst on `stream`: the copy kernel with `sms` blocks, or the copy engines.
extern "C" int nvlink_copy(void* dst, const void* src, size_t bytes, int sms, void* stream) {
    copy_kernel<<<sms, 512, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<int4*>(dst),
                                                                    static_cast<const int4*>(src), bytes / 16);
    return int(cudaGetLastError());
}

extern "C" int nvlink_copy_engine(void* dst, const void* src, size_t bytes, void* stream) {
    return int(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}
#else
enum Way { kPush, kPull, kCopyEngine, kCopyEnginePull };
static const char* kWayName[] = {"SM push (stores)", "SM pull (loads)", "CE, source GPU", "CE, target GPU"};

int main(int argc, char** argv) {
    const size_t mb = argc > 1 ? size_t(std::atoi(argv[1])) : 57;
    const size_t bytes = mb << 20, n = bytes / 16;
    int count = 0;
    CHECK(cudaGetDeviceCount(&count));
    if (count < 2) {
        std::fprintf(stderr, "needs 2 GPUs\n");
        return 1;
    }
    void *local[2], *remote_in[2];  // local[g]: source on g; remote_in[g]: landing buffer on g
    cudaStream_t stream[2];
    cudaEvent_t start[2], stop[2];
    for (int g = 0; g < 2; ++g) {
        CHECK(cudaSetDevice(g));
        CHECK(cudaDeviceEnablePeerAccess(1 - g, 0));
        CHECK(cudaMalloc(&local[g], bytes));
        CHECK(cudaMalloc(&remote_in[g], bytes));
        CHECK(cudaMemset(local[g], g + 1, bytes));
        CHECK(cudaStreamCreateWithFlags(&stream[g], cudaStreamNonBlocking));
        CHECK(cudaEventCreate(&start[g]));
        CHECK(cudaEventCreate(&stop[g]));
    }
    std::printf("%zu MB per direction; GB/s per direction (median of 10)\n", mb);
    std::printf("%-18s %5s %10s %10s\n", "way", "SMs", "one dir", "both dirs");
    const int sms_list[] = {16, 24, 32, 64, 132};
    for (int way = kPush; way <= kCopyEnginePull; ++way) {
        for (int sms : sms_list) {
            if (way >= kCopyEngine && sms != sms_list[0]) break;
            double result[2];
            for (int both = 0; both < 2; ++both) {
                std::vector<float> times;
                for (int rep = 0; rep < 12; ++rep) {
                    for (int g = 0; g < 2; ++g) {
                        CHECK(cudaSetDevice(g));
                        CHECK(cudaDeviceSynchronize());
                    }
                    const int senders = both ? 2 : 1;
                    for (int g = 0; g < senders; ++g) {  // data flows from g to 1 - g
                        const int runs_on = way == kPull || way == kCopyEnginePull ? 1 - g : g;
                        CHECK(cudaSetDevice(runs_on));
                        CHECK(cudaEventRecord(start[runs_on], stream[runs_on]));
                        if (way >= kCopyEngine) {
                            CHECK(cudaMemcpyPeerAsync(remote_in[1 - g], 1 - g, local[g], g, bytes, stream[runs_on]));
                        } else {
                            copy_kernel<<<sms, 512, 0, stream[runs_on]>>>(static_cast<int4*>(remote_in[1 - g]),
                                                                         static_cast<const int4*>(local[g]), n);
                            CHECK(cudaGetLastError());
                        }
                        CHECK(cudaEventRecord(stop[runs_on], stream[runs_on]));
                    }
                    float worst = 0.0f;
                    for (int g = 0; g < senders; ++g) {
                        const int runs_on = way == kPull || way == kCopyEnginePull ? 1 - g : g;
                        CHECK(cudaSetDevice(runs_on));
                        CHECK(cudaEventSynchronize(stop[runs_on]));
                        float ms = 0.0f;
                        CHECK(cudaEventElapsedTime(&ms, start[runs_on], stop[runs_on]));
                        worst = ms > worst ? ms : worst;
                    }
                    if (rep >= 2) times.push_back(worst);
                }
                std::sort(times.begin(), times.end());
                result[both] = double(bytes) / (times[times.size() / 2] * 1e-3) / 1e9;
            }
            std::printf("%-18s %5s %10.0f %10.0f\n", kWayName[way],
                        way >= kCopyEngine ? "-" : std::to_string(sms).c_str(), result[0], result[1]);
        }
    }
    return 0;
}
#endif  // NVLINK_CEILING_LIBRARY
