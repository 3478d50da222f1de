// Shared by the kernel translation units: the peer-buffer layout, the device view of a context,
// memory-ordering helpers for NVLink peer memory, timed spin-waits and error reporting.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "moe_ep.h"

namespace moe_ep {

constexpr int kMaxRanks = MOE_EP_MAX_RANKS;
#ifndef MOE_EP_CHUNK_ROWS
#define MOE_EP_CHUNK_ROWS 4  // a build-time tuning knob (moe_ep_plugin/_build.py: MOE_EP_NVCC_FLAGS)
#endif
constexpr int kChunkRows = MOE_EP_CHUNK_ROWS;  // rows published by one flag
static_assert(kChunkRows >= 1 && kChunkRows <= 16,
              "a chunk's rows are held by the lanes of one warp, and its "
              "output-row scratch must fit shared memory");
constexpr int kMaxRegionRows = 65536;  // rows one source may place in a peer region
constexpr int kMaxChunks = kMaxRegionRows / kChunkRows;
constexpr int kMaxExperts = MOE_EP_MAX_EXPERTS;
constexpr int kMetaWords = MOE_EP_META_WORDS;

// Every rank's buffer: [header | expert counts[R][kMaxExperts] | flags[R][kMaxChunks] | staging: one region per
// source rank].
struct Header {
    int signals[kMaxRanks];            // barrier arrivals, slot r incremented by rank r
    int counts[kMaxRanks][kMaxRanks];  // counts[i][j]: tokens rank i sends to rank j (written by rank i)
    int invalid[kMaxRanks];            // invalid[i]: out-of-range expert ids rank i found (written by rank i)
    int meta[kMaxRanks][kMetaWords];   // meta[i]: the words describing rank i's dispatch (written by rank i)
    int barrier_count;                 // barriers this rank completed; doubles as the sequence id of flags
    int abort;                         // first error code seen on this rank (sticky)
};
constexpr int64_t kHeaderBytes = 4096;

// Copy-engine combine (the row counts are known on the host): the copy streams ship a rank's rows to the peer in
// pieces with cudaMemcpyAsync, each piece flagged by a stream memory operation. All are 0 between operations (the
// last step of every copy-engine combine clears them).
constexpr int kMaxPieces = 32;
struct CopyFlags {
    int arrived[kMaxRanks][kMaxPieces];  // [src][piece]: 1 once src's copy engine has landed the piece here
};
constexpr int64_t kCopyFlagsOffset = 1024;             // inside the header page
constexpr int64_t kExpertCountsOffset = kHeaderBytes;  // [src][e]: tokens rank src sends to expert e
constexpr int64_t kFlagsOffset = kExpertCountsOffset + int64_t(kMaxRanks) * kMaxExperts * 4;
constexpr int64_t kStagingOffset = kFlagsOffset + int64_t(kMaxRanks) * kMaxChunks * 4;
static_assert(sizeof(Header) <= kCopyFlagsOffset && kCopyFlagsOffset + int64_t(sizeof(CopyFlags)) <= kHeaderBytes,
              "header too large");
static_assert(kStagingOffset % 4096 == 0, "staging must stay page aligned");

// What kernels need to reach every rank's buffer; passed by value.
struct DevCtx {
    char* bufs[kMaxRanks];  // bufs[rank] is local, the others are CUDA-IPC mappings of peer buffers
    int32_t* host_err;      // device alias of the host-mapped error record
    int64_t timeout_ns;
    int64_t region_bytes;
    int rank, num_ranks;
};

__device__ __forceinline__ Header* header(char* buf) {
    return reinterpret_cast<Header*>(buf);
}
__device__ __forceinline__ int* expert_counts(char* buf, int src) {
    return reinterpret_cast<int*>(buf + kExpertCountsOffset) + int64_t(src) * kMaxExperts;
}
__device__ __forceinline__ CopyFlags* copy_flags(char* buf) {
    return reinterpret_cast<CopyFlags*>(buf + kCopyFlagsOffset);
}
// Of a transfer of `count` rows, the rows the copy engines carry: all of them or none.
__host__ __device__ __forceinline__ int copied_rows(int count, bool copy_engine) {
    return copy_engine ? count : 0;
}
// Rows per copy-engine piece for a transfer of `count` rows: at least `min_rows`, at most kMaxPieces pieces, whole
// chunks. Sender (host) and receiver (kernel) compute it alike from the same count.
__host__ __device__ __forceinline__ int piece_rows(int count, int min_rows) {
    int rows = (count + kMaxPieces - 1) / kMaxPieces;
    rows = rows > min_rows ? rows : min_rows;
    return (rows + kChunkRows - 1) / kChunkRows * kChunkRows;
}
__device__ __forceinline__ int* flags(char* buf, int src) {
    return reinterpret_cast<int*>(buf + kFlagsOffset) + int64_t(src) * kMaxChunks;
}
__device__ __forceinline__ char* region(const DevCtx& c, int owner, int src) {
    return c.bufs[owner] + kStagingOffset + int64_t(src) * c.region_bytes;
}
// A pull combine's weights ([rows, num_topk] fp32) sit at the end of the rank's own region, at an offset every
// rank computes alike (the row count differs per rank); the rows fill the region from its start.
__host__ __device__ __forceinline__ int64_t pull_weights_offset(const DevCtx& c, int num_topk) {
    return (c.region_bytes - int64_t(kMaxRegionRows) * num_topk * 4) / 16 * 16;
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_volatile(const int* p) {
    return *reinterpret_cast<const volatile int*>(p);
}
__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// 16-byte load of memory another GPU wrote (after an acquire): coherent path, never the read-only cache.
__device__ __forceinline__ int4 ld_coherent(const int4* p) {
    int4 v;
    asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// First error wins: it sets this rank's abort flag (which ends every other wait quickly) and fills the host-mapped
// record Python reads. A timeout also names itself on stderr and traps: that ends this process's CUDA context, so
// the failing call's outputs (never fully written) raise a CUDA error when read instead of passing as data (DeepEP
// traps alike), and Python raises the recorded TimeoutError naming the rank wherever it checks first (its next
// call, or the failed host read inside this one). The other errors (ranks that disagree, a region or
// num_worst_tokens too small) are programming errors of one call: the context stays usable and the next call raises.
static __device__ __noinline__ void report_error(const DevCtx& c, int code, int a, int b) {
    if (atomicCAS(&header(c.bufs[c.rank])->abort, 0, code) == 0) {
        volatile int32_t* rec = c.host_err;
        rec[1] = a;
        rec[2] = b;
        rec[3] = c.rank;
        __threadfence_system();
        rec[0] = code;
        __threadfence_system();
        if (code == MOE_EP_ERR_BARRIER_TIMEOUT || code == MOE_EP_ERR_DISPATCH_TIMEOUT ||
            code == MOE_EP_ERR_COMBINE_TIMEOUT) {
            printf(
                "moe_ep_plugin: rank %d: timeout %d (%d, %d), see moe_ep.h; trapping: this process's CUDA "
                "context is lost\n",
                c.rank, code, a, b);
            __trap();
        }
    }
}

// Spin until *flag == target (or, with at_least, target - *flag <= 0 in wrapping arithmetic). Returns false
// when this rank has aborted or the wait exceeded the timeout (then the error is reported with a, b).
template <bool kAtLeast>
__device__ __noinline__ bool wait_flag(const DevCtx& c, const int* flag, int target, int code, int a, int b) {
    const int* abort = &header(c.bufs[c.rank])->abort;
    uint64_t start = 0;
    for (uint32_t iter = 0;; ++iter) {
        const int v = ld_acquire_sys(flag);
        if (kAtLeast ? (v - target >= 0) : (v == target)) return true;
        if ((iter & 255u) == 255u) {
            if (ld_volatile(abort) != 0) return false;
            const uint64_t t = now_ns();
            if (start == 0) {
                start = t;
            } else if (t - start > uint64_t(c.timeout_ns)) {
                report_error(c, code, a, b);
                return false;
            }
        }
    }
}

// 16 bytes of T (8 BF16, 8 FP16 or 4 FP32 values) added into fp32 accumulators, and fp32 accumulators rounded back
// (RNE): the one fp32 summation combine, unpermute and pad_sum use, so their sums match bit for bit. The two
// 16-bit types differ only in their pair type and its conversions (Half2 below).
template <typename T>
struct Vec;
template <typename Pair>
struct Half2;
template <>
struct Half2<__nv_bfloat162> {
    __device__ __forceinline__ static float2 to_float2(const __nv_bfloat162& v) { return __bfloat1622float2(v); }
    __device__ __forceinline__ static __nv_bfloat162 from_floats(float a, float b) {
        return __floats2bfloat162_rn(a, b);
    }
};
template <>
struct Half2<__half2> {
    __device__ __forceinline__ static float2 to_float2(const __half2& v) { return __half22float2(v); }
    __device__ __forceinline__ static __half2 from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};
template <typename Pair>
struct Vec16 {
    static constexpr int kN = 8;
    __device__ __forceinline__ static void add(float* acc, const int4& v) {
        const Pair* b = reinterpret_cast<const Pair*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = Half2<Pair>::to_float2(b[i]);
            acc[2 * i] += f.x;
            acc[2 * i + 1] += f.y;
        }
    }
    __device__ __forceinline__ static int4 pack(const float* acc) {
        int4 o;
        Pair* b = reinterpret_cast<Pair*>(&o);
#pragma unroll
        for (int i = 0; i < 4; ++i) b[i] = Half2<Pair>::from_floats(acc[2 * i], acc[2 * i + 1]);
        return o;
    }
};
template <>
struct Vec<__nv_bfloat16> : Vec16<__nv_bfloat162> {};
template <>
struct Vec<__half> : Vec16<__half2> {};
template <>
struct Vec<float> {
    static constexpr int kN = 4;
    __device__ __forceinline__ static void add(float* acc, const int4& v) {
        acc[0] += __int_as_float(v.x);
        acc[1] += __int_as_float(v.y);
        acc[2] += __int_as_float(v.z);
        acc[3] += __int_as_float(v.w);
    }
    __device__ __forceinline__ static int4 pack(const float* acc) {
        return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                         __float_as_int(acc[3]));
    }
};

// launch(float{}), launch(__nv_bfloat16{}) or launch(__half{}) for the element type of MOE_EP_DTYPE_* code
// `dtype` (csrc/moe_ep.h; a valid code: the caller checked it with dtype_bytes): every summing kernel is one
// template over T, instantiated for the three types here.
template <typename Launch>
int by_dtype(int64_t dtype, Launch&& launch) {
    switch (dtype) {
        case MOE_EP_DTYPE_BF16:
            return launch(__nv_bfloat16{});
        case MOE_EP_DTYPE_FP16:
            return launch(__half{});
        default:
            return launch(float{});
    }
}
// Bytes of an element of MOE_EP_DTYPE_* code `dtype`, 0 for another code.
inline int64_t dtype_bytes(int64_t dtype) {
    return dtype == MOE_EP_DTYPE_FP32 ? 4 : (dtype == MOE_EP_DTYPE_BF16 || dtype == MOE_EP_DTYPE_FP16) ? 2 : 0;
}

// Vector v of the sum of rows list[0, n) of y (row_vecs 16-byte vectors each), in fp32 from 0.0f in list order,
// rounded once to T; the loads of kBatch rows are in flight together. What unpermute writes per received row.
template <typename T, int kBatch>
__device__ __forceinline__ int4 sum_rows(const int4* y, int64_t row_vecs, const int* list, int n, int64_t v) {
    float acc[Vec<T>::kN];
#pragma unroll
    for (int i = 0; i < Vec<T>::kN; ++i) acc[i] = 0.0f;
    for (int j0 = 0; j0 < n; j0 += kBatch) {
        int4 buf[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (j0 + u < n) buf[u] = __ldg(y + int64_t(list[j0 + u]) * row_vecs + v);
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
            if (j0 + u < n) Vec<T>::add(acc, buf[u]);
    }
    return Vec<T>::pack(acc);
}

// Exclusive sum of `value` over the threads before this one (in thread order) of the whole block; `total` receives
// the block's sum. Every thread of the block calls it; blockDim.x is a multiple of 32. `scratch`: 33 ints of
// shared memory, reusable once the call returns.
__device__ __forceinline__ int block_exclusive_sum(int value, int* scratch, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inclusive = value;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += up;
    }
    if (lane == 31) scratch[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const int count = lane < int(blockDim.x >> 5) ? scratch[lane] : 0;
        int warp_inclusive = count;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int up = __shfl_up_sync(0xffffffffu, warp_inclusive, d);
            if (lane >= d) warp_inclusive += up;
        }
        scratch[lane] = warp_inclusive - count;
        if (lane == 31) scratch[32] = warp_inclusive;
    }
    __syncthreads();
    const int prefix = scratch[warp] + inclusive - value;
    total = scratch[32];
    __syncthreads();
    return prefix;
}

// Counting barrier over all ranks, run by one whole block. Every rank increments its slot in every peer's
// signals and waits until each peer's slot in its own buffer reached this rank's barrier count + 1; no reset is
// needed because all ranks run the same sequence of barriers. Prior writes of the block are made visible
// system-wide first. Returns false on timeout/abort.
static __device__ bool block_barrier(const DevCtx& c) {
    __shared__ int ok;
    Header* mine = header(c.bufs[c.rank]);
    __threadfence_system();
    __syncthreads();
    const int target = ld_volatile(&mine->barrier_count) + 1;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < c.num_ranks && peer != c.rank) atomicAdd_system(&header(c.bufs[peer])->signals[c.rank], 1);
    if (peer < c.num_ranks && peer != c.rank) {
        if (!wait_flag<true>(c, &mine->signals[peer], target, MOE_EP_ERR_BARRIER_TIMEOUT, peer, 0)) ok = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(&mine->barrier_count) = target;
    __syncthreads();
    return ok != 0;
}

}  // namespace moe_ep
