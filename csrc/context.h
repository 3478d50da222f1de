// Host-side context shared by runtime.cu (lifetime) and the kernel launchers.
#pragma once

#include <string>

#include "common.cuh"

namespace moe_ep {

struct Context {
    DevCtx dev;                         // what kernels see (peer pointers, error record, sizes)
    void* local = nullptr;              // this rank's cudaMalloc'd buffer
    volatile int32_t* host_err = nullptr;
    int64_t bytes = 0;
    int device = 0;
};

// Record `what` as the last error; returns a nonzero code.
int set_error(int code, const std::string& what);
int check_cuda(cudaError_t err, const char* what);
int check_launch(const char* what);

}  // namespace moe_ep
