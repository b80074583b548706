// fp8.cuh: bf16 -> e4m3fn quantisation with one scale per 128 channels, as reference.py defines it.
//
// scale = max(amax, EP_FP8_AMAX_FLOOR) / EP_FP8_E4M3_MAX, optionally rounded up to a power of two;
// q = saturate_rn(x / scale). The division (not a multiply by a reciprocal) is correctly rounded in
// CUDA and in numpy alike, so the kernel and the reference agree bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "types.cuh"

namespace ep {

__device__ __forceinline__ float round_scale_up_pow2(float scale) {
    uint32_t bits = __float_as_uint(scale);
    uint32_t exponent = (bits & 0x7F800000u) >> 23;
    exponent += (bits & 0x007FFFFFu) != 0u;
    return __uint_as_float(exponent << 23);
}

// The biased exponent of a power-of-two scale: the UE8M0 encoding.
__device__ __forceinline__ uint32_t ue8m0_byte(float scale) { return (__float_as_uint(scale) >> 23) & 0xFFu; }

__device__ __forceinline__ float fp8_scale_from_amax(float amax, bool round_scale) {
    const float scale = fmaxf(amax, EP_FP8_AMAX_FLOOR) / EP_FP8_E4M3_MAX;
    return round_scale ? round_scale_up_pow2(scale) : scale;
}

// Eight channels: eight floats in, eight e4m3 bytes out (as one uint2).
__device__ __forceinline__ uint2 quantize8(const float (&values)[8], float scale) {
    uint32_t words[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(values[i] / scale, __NV_SATFINITE, __NV_E4M3);
        words[i / 4] |= static_cast<uint32_t>(q) << (8 * (i % 4));
    }
    return make_uint2(words[0], words[1]);
}

__device__ __forceinline__ void unpack_bf16x8(const int4& packed, float (&values)[8]) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 pair = __bfloat1622float2(pairs[i]);
        values[2 * i] = pair.x;
        values[2 * i + 1] = pair.y;
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&values)[8]) {
    int4 packed;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(values[2 * i], values[2 * i + 1]);
    return packed;
}

}  // namespace ep
