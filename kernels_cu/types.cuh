// types.cuh: fixed-width integer types. NVRTC ships no C++ standard library headers, so under
// NVRTC they are spelled out here; a host compiler (the layout test) takes them from <cstdint>.
#pragma once

#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
static_assert(sizeof(int64_t) == 8 && sizeof(uint32_t) == 4, "fixed-width types");
#else
#include <cstdint>
#endif
