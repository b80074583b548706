// ll_combine.cu: low-latency combine, send and receive halves in one kernel chosen by `phases`.
// Macros: EP_NUM_THREADS, EP_MAX_RANKS, EP_MAX_EXPERTS, EP_MAX_TOPK.
//
// Protocol (pull), answering the dispatch that used the same parity:
//   Send half (never waits on a peer), on the expert rank:
//     - unless zero_copy (the caller wrote its outputs into combine_x already, through
//       Buffer.get_next_combine_buffer), copy the valid rows of expert_out into this rank's
//       combine_x[parity][e_l][row]; the valid rows are recv_range from the dispatch;
//     - the last block to finish stores, with st.release.sys, combine_flag[parity][rank] =
//       pack(step, 1) in every token-owner rank that active_ranks marks alive.
//   Receive half, on the token owner:
//     - threads d < R wait for combine_flag[parity][d] of every active expert rank (timed; a rank
//       that times out is written 0 in active_ranks and its experts are left out);
//     - each block reads, for every expert e of a live rank d, where this rank's rows start in d's
//       combine_x: d's recv_range[parity][e_l][rank].first; a copy (token, k) is then row
//       first + send_slot[token*K+k] (the slot this rank computed in its own dispatch);
//     - one warp per token pulls its K rows and accumulates w_k * y_k in fp32 with fmaf in k order
//       (renormalize: weights scaled by sum(all weights) / sum(live weights)), stores bf16.
//     - the last block to finish stores step into state.combine_step[parity].
// Epoch: step = state.combine_step[parity] + 1, read by every block at entry.
// Reuse: an expert rank rewrites combine_x[parity] two calls later, after its next dispatch on this
//        parity received this owner's tokens, which the owner sends only after this receive ended.
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
constexpr int kNumWarps = EP_NUM_THREADS / kWarpSize;
constexpr int kChannelsPerVector = 8;
// Vectors of one token one warp combines: 128 x 8 = 1024 channels, four vectors per lane.
constexpr int kChunkVectors = 4 * kWarpSize;

}  // namespace ep

using namespace ep;

extern "C" __global__ void __launch_bounds__(EP_NUM_THREADS, 1)
ll_combine(int phases, int parity, const Layout* __restrict__ layout_ptr, uint8_t* workspace, int rank,
           const int4* __restrict__ expert_out, int zero_copy, int num_tokens, const void* __restrict__ topk_idx,
           int topk_is_int64, int num_topk, const float* __restrict__ topk_weights, int* active_ranks,
           int4* combined_x, int renormalize, long long timeout_ns) {
    __shared__ int s_rows[EP_MAX_EXPERTS];  // send: first valid row of each local expert, flattened
    __shared__ int s_first[EP_MAX_EXPERTS];  // recv: first row of this rank's copies, per global expert
    __shared__ int s_scratch[kWarpSize + 1];
    __shared__ int s_live[EP_MAX_RANKS];

    const Layout layout = *layout_ptr;
    State* state = at<State>(workspace, layout.state);
    const uint64_t* route = at<uint64_t>(workspace, layout.route);
    const uint32_t step = state->combine_step[parity] + 1u;
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
        if (!zero_copy) {
            // Valid rows per local expert from the dispatch's recv_range: the last source's end.
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
        EP_TRACE_POINT(1);
        __syncthreads();
        if (finish_block(&state->combine_send_done[parity])) {
            for (int dst = 0; dst < num_ranks; ++dst) {
                if (ld_volatile(active_ranks + dst) == 0) continue;  // no bytes to a masked rank
                uint64_t* flag = reinterpret_cast<uint64_t*>(route[dst] + layout.combine_flag) +
                                 parity * EP_MAX_RANKS + rank;
                st_release_sys(flag, pack_flag(step, 1u));
            }
            EP_TRACE_POINT(2);
        }
    }

    if (phases & kPhaseRecv) {
        EP_TRACE_POINT(3);
        if (threadIdx.x < num_ranks) {
            const int src = threadIdx.x;
            bool live = false;
            if (ld_volatile(active_ranks + src) != 0) {
                const uint64_t* flag = at<uint64_t>(workspace, layout.combine_flag) + parity * EP_MAX_RANKS + src;
                uint32_t payload;
                live = wait_flag(flag, step, active_ranks, src, timeout_ns, &payload);
            }
            s_live[src] = live;
        }
        __syncthreads();
        EP_TRACE_POINT(4);
        const int num_experts = static_cast<int>(layout.num_experts);
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            const int expert_rank = e / num_local_experts, local_expert = e % num_local_experts;
            int first = 0;
            if (s_live[expert_rank]) {
                const int2* range = reinterpret_cast<const int2*>(route[expert_rank] + layout.recv_range[parity]);
                first = ld_cg_int(reinterpret_cast<const int*>(range + local_expert * num_ranks + rank));
            }
            s_first[e] = first;
        }
        __syncthreads();
        EP_TRACE_POINT(5);

        // Work item: one token's slice of kChunkVectors vectors, so that a few tokens still keep
        // every warp of the grid busy; each item recomputes its token's K row addresses (cheap).
        const int* send_slot = at<int>(workspace, layout.send_slot[parity]);
        const int num_chunks = (num_vectors + kChunkVectors - 1) / kChunkVectors;
        for (int item = global_warp; item < num_tokens * num_chunks; item += num_warps_total) {
            const int token = item / num_chunks, chunk = item % num_chunks;
            // Lane k holds top-k entry k; the row addresses and weights are broadcast below.
            int expert = -1;
            float weight = 0.0f;
            const int4* row = nullptr;
            if (lane < num_topk) {
                const int64_t i = static_cast<int64_t>(token) * num_topk + lane;
                expert = read_expert(topk_idx, topk_is_int64, i, static_cast<int>(layout.num_experts));
                weight = topk_weights[i];
                if (expert >= 0) {
                    const int expert_rank = expert / num_local_experts, local_expert = expert % num_local_experts;
                    if (s_live[expert_rank]) {
                        const int64_t row_idx = local_expert * num_rows_per_expert + s_first[expert] + send_slot[i];
                        row = reinterpret_cast<const int4*>(route[expert_rank] + layout.combine_x[parity]) +
                              row_idx * num_vectors;
                    }
                }
            }
            const bool valid = row != nullptr;
            if (renormalize) {
                const float total = warp_sum(expert >= 0 ? weight : 0.0f);
                const float kept = warp_sum(valid ? weight : 0.0f);
                weight = weight * (kept != 0.0f ? total / kept : 0.0f);
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
            const int end = min(num_vectors, (chunk + 1) * kChunkVectors);
            for (int v = chunk * kChunkVectors + lane; v < end; v += kWarpSize) {
                int4 vectors[EP_MAX_TOPK];
#pragma unroll
                for (int k = 0; k < EP_MAX_TOPK; ++k)
                    if ((valid_mask >> k) & 1u) vectors[k] = ld_cg_int4(rows[k] + v);
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int k = 0; k < EP_MAX_TOPK; ++k) {
                    if ((valid_mask >> k) & 1u) {
                        float values[8];
                        unpack_bf16x8(vectors[k], values);
#pragma unroll
                        for (int c = 0; c < 8; ++c) acc[c] = fmaf(weights[k], values[c], acc[c]);
                    }
                }
                out[v] = pack_bf16x8(acc);
            }
        }
        EP_TRACE_POINT(6);
        __syncthreads();
        if (finish_block(&state->combine_recv_done[parity])) {
            state->combine_step[parity] = step;
            EP_TRACE_POINT(7);
        }
    }
}
