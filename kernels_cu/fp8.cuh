// fp8.cuh: bf16 -> e4m3fn quantisation with one scale per 128 channels, as reference.py defines it.
//
// amax = max(max |x| over the block, EP_FP8_AMAX_FLOOR);
// scale = amax * (1 / EP_FP8_E4M3_MAX): the dequantisation scale that is stored (the reciprocal is a
// compile-time fp32 constant), optionally rounded up to a power of two;
// q = saturate_rn(x * multiplier), multiplier = EP_FP8_E4M3_MAX / amax, or 2^-e exactly when the
// scale is rounded to 2^e. At most one division per block and one multiply per channel, DeepEP's
// recipe. Each step is one correctly rounded fp32 operation (the _rn intrinsics: no FMA can
// contract them), in CUDA and in numpy alike, so the kernel and the reference agree bit for bit.
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

// The stored scale and the quantisation multiplier of a block whose max |x| is amax.
__device__ __forceinline__ void fp8_scales(float amax, bool round_scale, float* scale, float* multiplier) {
    constexpr float kInverseE4M3Max = 1.0f / EP_FP8_E4M3_MAX;  // rounded once, at compile time
    const float floored = fmaxf(amax, EP_FP8_AMAX_FLOOR);
    const float unrounded = __fmul_rn(floored, kInverseE4M3Max);
    if (round_scale) {
        *scale = round_scale_up_pow2(unrounded);
        // 2^-e from the exponent bits: exact, no division (the scale is a normal power of two). A
        // block holding inf rounds to an inf scale (exponent 255), whose reciprocal is 0, as the
        // reference's 1 / scale: the subtraction alone would wrap to -inf and flip every sign.
        const uint32_t exponent = (__float_as_uint(*scale) >> 23) & 0xFFu;
        *multiplier = __uint_as_float((254u - min(exponent, 254u)) << 23);
    } else {
        *scale = unrounded;
        *multiplier = __fdiv_rn(EP_FP8_E4M3_MAX, floored);
    }
}

// Eight channels: eight floats in, eight e4m3 bytes out (as one uint2), two per cvt instruction
// (the first of a pair lands in the low byte, as the channels lie in memory).
__device__ __forceinline__ uint2 quantize8(const float (&values)[8], float multiplier) {
    uint32_t words[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
        const float* v = values + 4 * w;
        const uint32_t low = __nv_cvt_float2_to_fp8x2(
            make_float2(__fmul_rn(v[0], multiplier), __fmul_rn(v[1], multiplier)), __NV_SATFINITE, __NV_E4M3);
        const uint32_t high = __nv_cvt_float2_to_fp8x2(
            make_float2(__fmul_rn(v[2], multiplier), __fmul_rn(v[3], multiplier)), __NV_SATFINITE, __NV_E4M3);
        words[w] = low | (high << 16);
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
