// ll_combine.cu: low-latency combine. One launch runs both halves (phases = send | receive); the
// hook mode launches the send half now and the receive half in hook().
// Macros: EP_NUM_THREADS, EP_MAX_RANKS, EP_MAX_EXPERTS, EP_MAX_TOPK, EP_SYS_SCOPE, EP_TRACE.
//
// Protocol (pull), answering the dispatch that used the same parity. `source` says where the token
// owners read this rank's expert outputs:
//   kSourceWorkspace  they are in this workspace's combine_x already (zero copy: the caller wrote
//                     them through Buffer.get_next_combine_buffer);
//   kSourceCopy       the send half copies the valid rows of expert_out into combine_x (transports
//                     whose peers cannot read the caller's memory);
//   kSourceDirect     the owners read expert_out itself (ranks of one process): no copy, and the
//                     receive half does not end before every owner said it has finished reading.
//   Send half (never waits on a peer), on the expert rank:
//     - copy rows if kSourceCopy (the valid rows are recv_range of the dispatch);
//     - block 0 writes combine_source[parity] (expert_out for kSourceDirect, else 0);
//     - one block stores, one thread per destination, with st.release, combine_flag[parity][rank] =
//       pack(step, 1) in every rank active_ranks marks alive: the last block to finish its copies
//       for kSourceCopy, else block 0 (nothing but its combine_source to publish).
//   Receive half, on the token owner:
//     - threads d < R of every block wait for combine_flag[parity][d] (timed; a rank that times out
//       is written 0 in active_ranks and its experts are left out), the grid's one verdict per rank
//       in combine_verdict[parity][d] (decide_source), then read d's combine_source;
//     - each block reads, for every expert e of a live rank d, where this rank's rows are among d's
//       rows: d's recv_range[parity][e_l][rank] = (first, count); copy (token, k) is row first +
//       send_slot[token*K+k] (the slot this rank computed in its own dispatch) if that slot is in
//       [0, count), else it adds nothing: d holds no rows of a rank it took as dead in the dispatch,
//       nor of one whose staging it timed out on (count 0 for both, ll_dispatch.cu, though this
//       combine may find d live and d us), and slot -1 is a dropped copy;
//     - warps share the tokens (several warps per token when tokens are few): a warp computes its
//       token's K row addresses once, then for each 16-byte column of its slices accumulates
//       w_k * y_k in fp32 with fmaf in k order (renormalize: weights scaled by sum(all weights) /
//       sum(live weights)) and stores bf16;
//     - the last block to finish acknowledges (combine_ack[parity][rank], release) every live rank
//       it read from directly; if this rank's own outputs were read directly it waits (timed) for
//       the acknowledgements of every live rank; then it stores step into state.combine_step[parity].
// Epoch: step = next_step(state.combine_step[parity]), read by every block at entry.
// Reuse: an expert rank rewrites combine_x[parity] two calls later, after its next dispatch on this
//        parity received this owner's tokens, which the owner sends only after this receive ended;
//        expert_out read directly is the caller's to reuse once this call's receive half is done.
#include <cuda_bf16.h>

#include "common.cuh"
#include "fp8.cuh"
#include "layout.cuh"
#include "signal.cuh"
#include "trace.cuh"

static_assert(EP_NUM_THREADS % 32 == 0 && EP_NUM_THREADS <= 1024, "EP_NUM_THREADS must be whole warps, <= 1024");
static_assert(EP_MAX_RANKS <= EP_NUM_THREADS, "one thread waits per expert rank");
static_assert(EP_MAX_TOPK <= 32, "one lane holds one top-k entry");

namespace ep {

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;
constexpr int kSourceWorkspace = 0;
constexpr int kSourceCopy = 1;
constexpr int kSourceDirect = 2;
static_assert(kSourceWorkspace == 0, "a published combine_source of 0 names the workspace's combine_x");
constexpr int kNumWarps = EP_NUM_THREADS / kWarpSize;
constexpr int kChannelsPerVector = 8;
// Top-k rows whose loads are in flight together, and vectors per lane per row: 8 x 2 x 16 bytes per
// lane in flight, without holding EP_MAX_TOPK rows of registers.
constexpr int kRowGroup = 8;
constexpr int kVectorsPerLane = 2;
// Vectors of one token a warp combines in one slice: 32 lanes x kVectorsPerLane.
constexpr int kSliceVectors = kVectorsPerLane * kWarpSize;

// out[v] for the vectors v = first + u * 32 (u < kVectorsPerLane) of one token: sum over the valid
// rows k (valid_mask) of weights[k] * rows[k][v], in fp32, in k order.
__device__ __forceinline__ void combine_slice(const int4* const (&rows)[EP_MAX_TOPK], const float (&weights)[EP_MAX_TOPK],
                                              unsigned valid_mask, int first, int num_vectors, int4* out) {
    float acc[kVectorsPerLane][8];
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[u][c] = 0.0f;
#pragma unroll
    for (int group = 0; group < EP_MAX_TOPK; group += kRowGroup) {
        if ((valid_mask >> group) == 0u) break;
        int4 vectors[kRowGroup][kVectorsPerLane];
#pragma unroll
        for (int k = 0; k < kRowGroup; ++k)
#pragma unroll
            for (int u = 0; u < kVectorsPerLane; ++u) {
                const int v = first + u * kWarpSize;
                if (((valid_mask >> (group + k)) & 1u) && v < num_vectors) vectors[k][u] = ld_once_int4(rows[group + k] + v);
            }
#pragma unroll
        for (int k = 0; k < kRowGroup; ++k) {
            if (!((valid_mask >> (group + k)) & 1u)) continue;
#pragma unroll
            for (int u = 0; u < kVectorsPerLane; ++u) {
                float values[8];
                unpack_bf16x8(vectors[k][u], values);
#pragma unroll
                for (int c = 0; c < 8; ++c) acc[u][c] = fmaf(weights[group + k], values[c], acc[u][c]);
            }
        }
    }
#pragma unroll
    for (int u = 0; u < kVectorsPerLane; ++u) {
        const int v = first + u * kWarpSize;
        if (v < num_vectors) out[v] = pack_bf16x8(acc[u]);
    }
}

}  // namespace ep

using namespace ep;

extern "C" __global__ void __launch_bounds__(EP_NUM_THREADS, 1)
ll_combine(int phases, int parity, const Layout* __restrict__ layout_ptr, uint8_t* workspace, int rank,
           const int4* __restrict__ expert_out, int source, int num_tokens, const void* __restrict__ topk_idx,
           int topk_is_int64, int num_topk, const float* __restrict__ topk_weights, int* active_ranks,
           int4* combined_x, int renormalize, long long timeout_ns) {
    __shared__ int s_rows[EP_MAX_EXPERTS];  // send: first valid row of each local expert, flattened
    // recv: where this rank's copies are among each global expert's rows, (first, count): d's recv_range
    __shared__ int2 s_range[EP_MAX_EXPERTS];
    __shared__ uint64_t s_base[EP_MAX_RANKS];  // recv: where rank d's expert output rows start
    __shared__ int s_direct[EP_MAX_RANKS];     // recv: rank d's rows were read from its caller's array
    __shared__ int s_scratch[kWarpSize + 1];
    __shared__ int s_live[EP_MAX_RANKS];
    __shared__ int s_is_last;

    const Layout& layout = *layout_ptr;
    State* state = at<State>(workspace, layout.state);
    const uint64_t* route = at<uint64_t>(workspace, layout.route);
    const uint32_t step = next_step(state->combine_step[parity]);
    const int num_ranks = static_cast<int>(layout.num_ranks);
    const int num_local_experts = static_cast<int>(layout.num_local_experts);
    const int hidden = static_cast<int>(layout.hidden);
    const int num_vectors = hidden / kChannelsPerVector;
    const int64_t num_rows_per_expert = static_cast<int64_t>(num_ranks) * layout.num_max_tokens;
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int num_warps_total = gridDim.x * kNumWarps;
    const int global_warp = blockIdx.x * kNumWarps + warp;

    if (phases & kPhaseSend) {
        EP_TRACE_POINT(0);
        if (source == kSourceCopy) {
            // Valid rows per local expert from the dispatch's recv_range: the last source's end (short
            // of recv_count when that source's staging timed out: its zero rows nobody reads back).
            const int2* recv_range = at<int2>(workspace, layout.recv_range[parity]);
            for (int e = threadIdx.x; e < num_local_experts; e += blockDim.x) {
                const int2 last = recv_range[e * num_ranks + num_ranks - 1];
                s_rows[e] = last.x + last.y;
            }
            __syncthreads();
            const int num_valid_rows = block_exclusive_scan(s_rows, num_local_experts, s_scratch);
            int4* combine_x = at<int4>(workspace, layout.combine_x[parity]);
            for (int row = global_warp; row < num_valid_rows; row += num_warps_total) {
                const int local_expert = upper_bound(s_rows, num_local_experts, row) - 1;
                const int64_t offset = (local_expert * num_rows_per_expert + row - s_rows[local_expert]) * num_vectors;
                warp_copy(expert_out + offset, combine_x + offset, num_vectors);
            }
        }
        if (blockIdx.x == 0 && threadIdx.x == 0)
            at<uint64_t>(workspace, layout.combine_source)[parity] =
                source == kSourceDirect ? reinterpret_cast<uint64_t>(expert_out) : 0ull;
        EP_TRACE_POINT(1);
        // With copied rows every block's copies are published, so the grid's last block signals.
        // Otherwise block 0's combine_source is the one thing this half writes (the rows were written
        // by kernels before this one on the stream): block 0 signals after its own barrier, and the
        // last rank to launch does not also wait for a grid-wide counter.
        bool signal;
        if (source == kSourceCopy) {
            signal = finish_block(&state->combine_send_done[parity], &s_is_last);
        } else {
            signal = blockIdx.x == 0;
            if (signal) __syncthreads();
        }
        if (signal) {
            signal_ranks(route, layout.combine_flag, parity * EP_MAX_RANKS + rank, num_ranks, active_ranks,
                         pack_flag(step, 1u));
            EP_TRACE_POINT(2);
        }
    }

    if (phases & kPhaseRecv) {
        EP_TRACE_POINT(3);
        // One verdict per expert rank for the grid: blocks that each timed a rank on their own clock
        // could disagree on it (some tokens with its experts, some without, renormalised apart).
        decide_ranks(at<uint64_t>(workspace, layout.combine_verdict) + parity * EP_MAX_RANKS,
                     at<uint64_t>(workspace, layout.combine_flag) + parity * EP_MAX_RANKS, step, active_ranks,
                     num_ranks, rank, (phases & kPhaseSend) != 0, timeout_ns, s_live);
        if (threadIdx.x < num_ranks) {
            const int d = threadIdx.x;
            // Published by d before its flag, whose live verdict this thread acquired in decide_ranks.
            const auto* combine_source = reinterpret_cast<const uint64_t*>(route[d] + layout.combine_source);
            const uint64_t direct = s_live[d] ? ld_cg_u64(combine_source + parity) : 0ull;
            s_direct[d] = direct != 0ull;
            s_base[d] = direct != 0ull ? direct : route[d] + layout.combine_x[parity];
        }
        EP_TRACE_POINT(4);
        const int num_experts = static_cast<int>(layout.num_experts);
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            const int expert_rank = e / num_local_experts, local_expert = e % num_local_experts;
            int2 range = make_int2(0, 0);
            if (s_live[expert_rank])
                range = ld_cg_int2(reinterpret_cast<const int2*>(route[expert_rank] + layout.recv_range[parity]) +
                                   local_expert * num_ranks + rank);
            s_range[e] = range;
        }
        __syncthreads();
        EP_TRACE_POINT(5);

        // `split` warps share a token (each its slices split, split + 1, ...), so that a few tokens
        // still keep every warp busy; a warp computes its token's K row addresses once.
        const int* send_slot = at<int>(workspace, layout.send_slot[parity]);
        const int num_slices = (num_vectors + kSliceVectors - 1) / kSliceVectors;
        const int split = max(1, min(num_slices, num_warps_total / max(num_tokens, 1)));
        const int num_token_groups = num_warps_total / split;
        const int token_group = global_warp / split, slice_offset = global_warp % split;
        for (int token = token_group; token_group < num_token_groups && token < num_tokens; token += num_token_groups) {
            // Lane k holds top-k entry k; the row addresses and weights are broadcast below.
            int expert = -1;
            float weight = 0.0f;
            const int4* row = nullptr;
            if (lane < num_topk) {
                const int64_t i = static_cast<int64_t>(token) * num_topk + lane;
                expert = read_expert(topk_idx, topk_is_int64, i, num_experts);
                weight = topk_weights[i];
                // A copy the dispatch dropped or never had (slot -1: past T, or combine names an
                // expert where the dispatch had -1) is a -1 entry: it adds nothing and, under
                // renormalize, is not part of the token's total either.
                const int slot = expert >= 0 ? send_slot[i] : -1;
                if (slot < 0) expert = -1;
                if (expert >= 0) {
                    const int expert_rank = expert / num_local_experts, local_expert = expert % num_local_experts;
                    // A row the expert rank holds: none from a rank it took as dead in the dispatch
                    // (count 0, even if this combine finds it live).
                    const int2 range = s_range[expert];
                    if (s_live[expert_rank] && slot < range.y) {
                        const int64_t row_idx = local_expert * num_rows_per_expert + range.x + slot;
                        row = reinterpret_cast<const int4*>(s_base[expert_rank]) + row_idx * num_vectors;
                    }
                }
            }
            const bool valid = row != nullptr;
            if (renormalize) {
                const float total = warp_sum(expert >= 0 ? weight : 0.0f);
                const float kept = warp_sum(valid ? weight : 0.0f);
                // Live weights summing to 0 are kept for a total of 0 (weights that cancel), else
                // dropped: no factor scales them to another total.
                weight = weight * (kept != 0.0f ? total / kept : (total == 0.0f ? 1.0f : 0.0f));
            }
            const unsigned valid_mask = __ballot_sync(kFullMask, valid);
            float weights[EP_MAX_TOPK];
            const int4* rows[EP_MAX_TOPK];
#pragma unroll
            for (int k = 0; k < EP_MAX_TOPK; ++k) {
                weights[k] = __shfl_sync(kFullMask, weight, k);
                rows[k] = reinterpret_cast<const int4*>(__shfl_sync(kFullMask, reinterpret_cast<uint64_t>(row), k));
            }
            int4* out = combined_x + static_cast<int64_t>(token) * num_vectors;
            for (int slice = slice_offset; slice < num_slices; slice += split)
                combine_slice(rows, weights, valid_mask, slice * kSliceVectors + lane, num_vectors, out);
        }
        EP_TRACE_POINT(6);
        if (finish_block(&state->combine_recv_done[parity], &s_is_last)) {
            // Every block's reads of the peers' rows are done: tell the ranks read directly.
            if (threadIdx.x < num_ranks && s_direct[threadIdx.x])
                st_release_sys(reinterpret_cast<uint64_t*>(route[threadIdx.x] + layout.combine_ack) +
                                   parity * EP_MAX_RANKS + rank,
                               pack_flag(step, 1u));
            // Our own expert_out may be reused by the caller only after every reader is done.
            if (source == kSourceDirect)
                wait_ranks(at<uint64_t>(workspace, layout.combine_ack) + parity * EP_MAX_RANKS, step, active_ranks,
                           num_ranks, rank, (phases & kPhaseSend) != 0, timeout_ns, s_live);
            if (threadIdx.x == 0) {
                state->combine_step[parity] = step;
                EP_TRACE_POINT(7);
            }
        }
    }
}
