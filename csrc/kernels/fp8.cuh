// FP8 1x128 block quantization shared by the kernels that quantize in their send path (intranode.cu,
// low_latency.cu): bit for bit moe_ep_plugin.fp8.quantize.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace moe_ep {

constexpr float kFp8Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

// Input rows of the quantizing send path, read 16 channels per lane: BF16 = 2 vectors, FP32 = 4 vectors.
template <typename T>
struct In16 {
    static constexpr int kVecs = 16 * int(sizeof(T)) / 16;
    __device__ static float get(const int4* raw, int i);
};
template <>
__device__ __forceinline__ float In16<__nv_bfloat16>::get(const int4* raw, int i) {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(raw)[i]);
}
template <>
__device__ __forceinline__ float In16<float>::get(const int4* raw, int i) {
    return reinterpret_cast<const float*>(raw)[i];
}

__device__ __forceinline__ float fp8_to_float(uint32_t byte) {
    __nv_fp8_e4m3 f;
    f.__x = static_cast<__nv_fp8_storage_t>(byte);
    return float(f);
}

// 16 FP8 bytes times `scale` (fp32 products) → 16 values of OutT (BF16 rounded to nearest even, or FP32), packed
// into sizeof(OutT) 16-byte vectors.
template <typename OutT>
__device__ __forceinline__ void dequant16(const int4& q, float scale, int4 (&o)[sizeof(OutT)]) {
    const uint32_t words[4] = {uint32_t(q.x), uint32_t(q.y), uint32_t(q.z), uint32_t(q.w)};
    float f[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) f[i] = __fmul_rn(fp8_to_float((words[i / 4] >> (8 * (i % 4))) & 0xffu), scale);
    if constexpr (sizeof(OutT) == 2) {
        __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(o);
#pragma unroll
        for (int i = 0; i < 8; ++i) ob[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            o[i] = make_int4(__float_as_int(f[4 * i]), __float_as_int(f[4 * i + 1]), __float_as_int(f[4 * i + 2]),
                             __float_as_int(f[4 * i + 3]));
    }
}

template <typename OutT>
__device__ __forceinline__ void store16(OutT* out, const int4 (&o)[sizeof(OutT)]) {
#pragma unroll
    for (int i = 0; i < int(sizeof(OutT)); ++i) reinterpret_cast<int4*>(out)[i] = o[i];
}

template <typename OutT>
__device__ __forceinline__ void store_dequant16(OutT* out, const int4& q, float scale) {
    int4 o[sizeof(OutT)];
    dequant16<OutT>(q, scale, o);
    store16(out, o);
}

#ifndef MOE_EP_QUANT_LOADS
#define MOE_EP_QUANT_LOADS 8  // a build-time tuning knob: 16-byte loads in flight per lane while quantizing
#endif
constexpr int kQuantLoads = MOE_EP_QUANT_LOADS;

// Warp-wide 1x128 FP8 quantization of one row, exactly moe_ep_plugin.fp8.quantize: amax floored at 1e-4;
// scale = amax / 448, q = fp8(x * (448 / amax)) with IEEE fp32 divisions; with round_scale
// scale = 2^ceil(log2(amax / 448)) from the exponent bits and q = fp8(x * (1 / scale)). RNE, satfinite.
// Each lane handles 16 channels of a 512-channel group (8 lanes = one 128-channel block); the loads of
// kGroups groups are issued together. Any of the outputs (q_wire/s_wire, a local copy q_out/s_out, deq_out: the
// dequantized row in type T) may be null.
template <typename T>
__device__ __forceinline__ void quantize_row(const T* x, int hidden, uint8_t* q_wire, float* s_wire, uint8_t* q_out,
                                             float* s_out, T* deq_out, bool round_scale, int lane) {
    constexpr int kVecs = In16<T>::kVecs;
    constexpr int kGroups = kQuantLoads / kVecs > 0 ? kQuantLoads / kVecs : 1;
#pragma unroll 1
    for (int base = 0; base < hidden; base += 512 * kGroups) {
        int4 raw[kGroups][kVecs];
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const int c0 = base + 512 * g + lane * 16;
#pragma unroll
            for (int v = 0; v < kVecs; ++v)
                raw[g][v] = c0 < hidden ? __ldg(reinterpret_cast<const int4*>(x + c0) + v) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            const int c0 = base + 512 * g + lane * 16;
            if (base + 512 * g >= hidden) break;  // warp-uniform
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(In16<T>::get(raw[g], i)));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
            amax = fmaxf(amax, kAmaxFloor);
            float scale, factor;
            if (round_scale) {
                const uint32_t bits = __float_as_uint(__fdiv_rn(amax, kFp8Max));
                const uint32_t exponent = ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
                scale = __uint_as_float(exponent << 23);
                factor = __frcp_rn(scale);
            } else {
                scale = __fdiv_rn(amax, kFp8Max);
                factor = __fdiv_rn(kFp8Max, amax);
            }
            if (c0 >= hidden) continue;
            uint32_t words[4];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const __nv_fp8x2_storage_t lo =
                    __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(In16<T>::get(raw[g], 4 * w), factor),
                                                         __fmul_rn(In16<T>::get(raw[g], 4 * w + 1), factor)),
                                             __NV_SATFINITE, __NV_E4M3);
                const __nv_fp8x2_storage_t hi =
                    __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(In16<T>::get(raw[g], 4 * w + 2), factor),
                                                         __fmul_rn(In16<T>::get(raw[g], 4 * w + 3), factor)),
                                             __NV_SATFINITE, __NV_E4M3);
                words[w] = uint32_t(lo) | (uint32_t(hi) << 16);
            }
            const int4 q = make_int4(int(words[0]), int(words[1]), int(words[2]), int(words[3]));
            const bool scale_lane = (lane & 7) == 0;
            if (q_wire != nullptr) *reinterpret_cast<int4*>(q_wire + c0) = q;
            if (s_wire != nullptr && scale_lane) s_wire[c0 / 128] = scale;
            if (q_out != nullptr) *reinterpret_cast<int4*>(q_out + c0) = q;
            if (s_out != nullptr && scale_lane) s_out[c0 / 128] = scale;
            if (deq_out != nullptr) store_dequant16(deq_out + c0, q, scale);
        }
    }
}

}  // namespace moe_ep
