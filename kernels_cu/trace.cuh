// trace.cuh: optional per-block timestamps, for finding where a phase spends its time.
//
// Only builds with EP_TRACE=1 record anything (scripts/trace_phases.py makes them); every other
// build compiles EP_TRACE_POINT to nothing. A traced module holds one array in device memory,
//   ep_trace[EP_TRACE_MAX_RANKS][EP_TRACE_NUM_POINTS][EP_TRACE_MAX_BLOCKS]   u64 %globaltimer (ns)
// written by thread 0 of each block at each named point of a kernel, overwritten by every launch:
// read after a replay, it is that replay's timeline. Indexed by the kernel's `rank` argument: the
// in-process ranks of one device share one loaded module (kernels.py), hence one array.
// %globaltimer is common to all SMs, so points of different blocks and of different ranks' kernels
// can be compared. Points, in both protocols:
//   0 send entry   1 send work done   2 flags stored   3 receive entry
//   4 flags seen   5 receive plan ready   6 rows done   7 receive exit (last block)   8 staging seen
//   9-13 dispatch block 0's list building, step by step (below)
//   14 dispatch plan: every live source's offsets loaded   15 dispatch: warp 0's first rows found
//      (with DeepEP's column-major scales, the block's first window of rows, after a barrier)
// Dispatch: 1 is block 0's lists, or warp 0's staging in a staging block (with one block, the
// latter overwrites the former); 2 block 0's routing flags; 4 and 5 are the planning warp's (every
// source's verdict in, the plan in shared memory); 8 every source's staging seen, after which the
// rows are copied. Block 0's lists: 9 copies counted per expert, 10 prefix written (the routing
// flag's payload, before its stores), 11 the last chunk's experts loaded, 12 its bitmap set, 13 its
// slots and list entries written, by the bitmap or, for a chunk with a repeated expert, serially
// (1 follows once they are published). Combine: 2 is the signalling
// block's; it records no 8 and none of 9-13.
#pragma once

#include "ptx.cuh"

#ifndef EP_TRACE
#define EP_TRACE 0
#endif

#if EP_TRACE
#define EP_TRACE_NUM_POINTS 16
#define EP_TRACE_MAX_BLOCKS 256
#define EP_TRACE_MAX_RANKS 8
extern "C" {
__device__ uint64_t ep_trace[EP_TRACE_MAX_RANKS][EP_TRACE_NUM_POINTS][EP_TRACE_MAX_BLOCKS];  // found by name
}
// Uses the kernel's `rank`; ranks past EP_TRACE_MAX_RANKS record nothing.
#define EP_TRACE_POINT(point)                                                                 \
    do {                                                                                      \
        if (threadIdx.x == 0 && blockIdx.x < EP_TRACE_MAX_BLOCKS && rank < EP_TRACE_MAX_RANKS) \
            ep_trace[rank][(point)][blockIdx.x] = ep::global_timer_ns();                      \
    } while (0)
// The same, recorded by lane 0 of the warp that reaches it (a point only one warp passes).
#define EP_TRACE_POINT_WARP(point)                                                                        \
    do {                                                                                                  \
        if (threadIdx.x % 32 == 0 && blockIdx.x < EP_TRACE_MAX_BLOCKS && rank < EP_TRACE_MAX_RANKS)        \
            ep_trace[rank][(point)][blockIdx.x] = ep::global_timer_ns();                                  \
    } while (0)
#else
#define EP_TRACE_POINT(point) \
    do {                      \
    } while (0)
#define EP_TRACE_POINT_WARP(point) \
    do {                           \
    } while (0)
#endif
