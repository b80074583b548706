// common.cuh: small block- and warp-level building blocks shared by the protocols.
//
//   warp_inclusive_scan        shfl_up scan of one int per lane
//   block_exclusive_scan       in-place exclusive prefix of a shared array of any length; all
//                              threads of the block call it; returns the total
//   warp_exclusive_scan        the same, by one warp, while the rest of the block does other work
//   upper_bound                first index whose value is > key in a non-decreasing shared array
//   finish_block               the block finish counter: returns true in every thread of the last
//                              block of the grid to finish a phase, with every earlier block's
//                              writes ordered before (fence / relaxed atomic / fence, barrier);
//                              that block resets the counter for the next call on this parity;
//                              a block may also mark the phase, and the last one learns whether any did
//   warp_copy                  one warp copies 16-byte vectors, kCopyUnroll loads in flight per lane
#pragma once

#include "types.cuh"

#include "ptx.cuh"

namespace ep {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWarpSize = 32;

__device__ __forceinline__ int warp_inclusive_scan(int value) {
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll
    for (int delta = 1; delta < kWarpSize; delta *= 2) {
        const int other = __shfl_up_sync(kFullMask, value, delta);
        if (lane >= delta) value += other;
    }
    return value;
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int mask = kWarpSize / 2; mask > 0; mask /= 2) value += __shfl_xor_sync(kFullMask, value, mask);
    return value;
}

// warp_sums: shared scratch of kWarpSize + 1 ints. blockDim.x must be a multiple of 32, <= 1024.
__device__ int block_exclusive_scan(int* values, int count, int* warp_sums) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    const int num_warps = blockDim.x / kWarpSize;
    int carry = 0;
    for (int base = 0; base < count; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const int value = i < count ? values[i] : 0;
        const int inclusive = warp_inclusive_scan(value);
        if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
        __syncthreads();
        if (warp == 0) {
            const int sum = lane < num_warps ? warp_sums[lane] : 0;
            const int prefix = warp_inclusive_scan(sum);
            if (lane < num_warps) warp_sums[lane] = prefix - sum;
            if (lane == kWarpSize - 1) warp_sums[kWarpSize] = prefix;  // the chunk's total
        }
        __syncthreads();
        if (i < count) values[i] = carry + warp_sums[warp] + inclusive - value;
        carry += warp_sums[kWarpSize];
        __syncthreads();
    }
    return carry;
}

// One warp: lane l scans a contiguous segment of `values` serially, the segment sums are scanned across
// the lanes. Returns the total in every lane; the values are visible to the warp after it returns.
__device__ int warp_exclusive_scan(int* values, int count) {
    const int lane = threadIdx.x % kWarpSize;
    const int per_lane = (count + kWarpSize - 1) / kWarpSize;
    const int begin = min(count, lane * per_lane), end = min(count, begin + per_lane);
    int sum = 0;
    for (int i = begin; i < end; ++i) sum += values[i];
    const int inclusive = warp_inclusive_scan(sum);
    int running = inclusive - sum;
    for (int i = begin; i < end; ++i) {
        const int value = values[i];
        values[i] = running;
        running += value;
    }
    __syncwarp();
    return __shfl_sync(kFullMask, inclusive, kWarpSize - 1);
}

__device__ __forceinline__ int upper_bound(const int* values, int count, int key) {
    int low = 0, high = count;
    while (low < high) {
        const int mid = (low + high) / 2;
        if (values[mid] <= key) low = mid + 1;
        else high = mid;
    }
    return low;
}

// Every thread of the block calls it after its last access of a phase. Returns true, in every thread,
// in the one block of the grid that finishes last; that block's threads then see every other block's
// writes of the phase (fence / relaxed atomic / fence in thread 0, then the barrier), and it resets
// the counter for the next call on this parity (stream order publishes the reset).
// With s_any_marked: a block passes marked (the same in all its threads), and the last block finds in
// *s_any_marked whether any block of the grid did. The marks ride on the counter's atomic, above the
// bits that count blocks, so a phase nobody marked costs no load more.
constexpr uint32_t kFinishMark = 1u << 16;  // above any grid's block count
__device__ __forceinline__ bool finish_block(uint32_t* counter, int* s_is_last, bool marked = false,
                                             int* s_any_marked = nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) {
        fence_acq_rel_sys();
        const uint32_t before = atomicAdd(counter, 1u + (marked ? kFinishMark : 0u));
        const bool is_last = (before & (kFinishMark - 1u)) == gridDim.x - 1;
        if (is_last) {
            fence_acq_rel_sys();
            *counter = 0u;
        }
        *s_is_last = is_last;
        if (s_any_marked != nullptr) *s_any_marked = marked || before >= kFinishMark;
    }
    __syncthreads();
    return *s_is_last;
}

// One warp copies num_vectors 16-byte vectors, kCopyUnroll loads in flight per lane before the first
// store. Loads bypass L1 (.cg): the source may be a peer's buffer written by a kernel running now.
// kStreamStores: the destination is a result only later kernels read (st_once).
constexpr int kCopyUnroll = 8;
template <bool kStreamStores = false>
__device__ __forceinline__ void warp_copy(const int4* src, int4* dst, int num_vectors) {
    const int lane = threadIdx.x % kWarpSize;
    for (int base = 0; base < num_vectors; base += kCopyUnroll * kWarpSize) {
        int4 vectors[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int v = base + u * kWarpSize + lane;
            if (v < num_vectors) vectors[u] = ld_cg_int4(src + v);
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int v = base + u * kWarpSize + lane;
            if (v < num_vectors) {
                if (kStreamStores) st_once(dst + v, vectors[u]);
                else dst[v] = vectors[u];
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ T* at(uint8_t* base, int64_t offset) {
    return reinterpret_cast<T*>(base + offset);
}

// Entry i of topk_idx (int64 or int32). Ids outside [0, num_experts) read as -1 ("no expert"): the
// host cannot check ids of device arrays without a sync, and an out-of-range id must never index
// memory.
__device__ __forceinline__ int read_expert(const void* topk_idx, int is_int64, int64_t i, int num_experts) {
    const int64_t expert = is_int64 ? static_cast<const int64_t*>(topk_idx)[i] : static_cast<const int*>(topk_idx)[i];
    return expert >= 0 && expert < num_experts ? static_cast<int>(expert) : -1;
}

}  // namespace ep
