// ptx.cuh: the memory-ordering and timing primitives every protocol in this folder is built on.
//
// Contract:
//   ld_acquire_sys / st_release_sys   flag accesses that order everything before a release store
//                                     (in this thread, and in threads that synchronised with it
//                                     through a barrier) before everything after the acquire load
//                                     that reads it, across GPUs and processes.
//   fence_acq_rel_sys                 the fence half of a release/acquire pattern built on relaxed
//                                     atomics (block finish counters).
//   ld_acquire_u32 / red_add_release  a counter that publishes what its adders wrote: each adder's
//                                     release increment orders its writes (and, through a barrier or
//                                     __syncwarp, its block's or warp's) before any acquire load
//                                     that sees the sum.
//   ld_cg_*                           loads that bypass L1: data written by another kernel that runs
//                                     at the same time (a peer rank) must never come from a stale
//                                     L1 line, and must never use the read-only (.nc) path.
//   ld_input_int4, ld_once_int4,      bulk rows with the cache policy that suits each (below); only
//   st_once                           the caller's own input, which no kernel writes meanwhile, is
//                                     read on the .nc path.
//   global_timer_ns                   %globaltimer, a nanosecond clock common to all SMs.
//
// Scope: EP_SYS_SCOPE=1 (peers on other GPUs or in other processes) orders at .sys scope; when
// every rank of the buffer is on this GPU, EP_SYS_SCOPE=0 uses .gpu scope, which is enough there
// and spares the system-wide fence its cost.
#pragma once

#if EP_SYS_SCOPE
#define EP_SCOPE "sys"
#else
#define EP_SCOPE "gpu"
#endif

#include "types.cuh"

namespace ep {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
    uint64_t value;
    asm volatile("ld.acquire." EP_SCOPE ".global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t value) {
    asm volatile("st.release." EP_SCOPE ".global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* ptr) {
    int value;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint32_t ld_acquire_u32(const uint32_t* ptr) {
    uint32_t value;
    asm volatile("ld.acquire." EP_SCOPE ".global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ void red_add_release(uint32_t* ptr, uint32_t value) {
    asm volatile("red.release." EP_SCOPE ".global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel." EP_SCOPE ";" ::: "memory"); }

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

__device__ __forceinline__ int4 ld_cg_int4(const int4* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ int ld_cg_int(const int* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ int2 ld_cg_int2(const int2* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ float ld_cg_float(const float* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ uint64_t ld_cg_u64(const uint64_t* ptr) {
    return __ldcg(reinterpret_cast<const unsigned long long*>(ptr));
}

// Cache policies of the bulk rows (chosen by A/B on the H200, scripts/ab_kernels.py, 2026-12-03:
// together decode dispatch 55 -> 48 us, combine 64 -> 60 us, the same run; docs/performance.md).
// The 256-byte L2 fetch size needs sm_80; older GPUs get the plain .nc / .cg loads.
//
// ld_input_int4: the caller's tokens (dispatch's x), read once and written by no kernel while this
// one runs (the caller's stream ordered their writes before the launch): the read-only path, no L1
// allocation, 256-byte L2 fetches.
__device__ __forceinline__ int4 ld_input_int4(const int4* ptr) {
#if __CUDA_ARCH__ >= 800
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
#else
    return __ldg(ptr);
#endif
}

// ld_once_int4: rows read once that another kernel wrote (combine's expert outputs, a peer's): a
// weak load with no L1 allocation and 256-byte L2 fetches. Like ld_cg_*, it may only follow an
// acquire of the writer's flag in this block (then a barrier): the acquire, not the allocation
// hint, is what keeps a stale L1 line from serving it. Not for rows other readers take again from
// L2 (dispatch's staged rows: 256-byte fetches made its copies 10% slower).
__device__ __forceinline__ int4 ld_once_int4(const int4* ptr) {
#if __CUDA_ARCH__ >= 800
    int4 v;
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
#else
    return __ldcg(ptr);
#endif
}

// st_once: results written once and read only by later kernels (dispatch's recv_x rows, and its
// row-major scales): streaming stores (.cs, evict-first in L2), so that the 60 MB a decode dispatch
// writes do not push out of L2 the staged rows that every receiver is still reading.
template <typename T>
__device__ __forceinline__ void st_once(T* ptr, const T& value) {
    __stcs(ptr, value);
}

}  // namespace ep
