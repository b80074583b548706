// ll_dispatch.cu: low-latency dispatch. One launch runs both halves (phases = send | receive); the
// hook mode launches the send half now and the receive half in hook().
// Macros: EP_USE_FP8, EP_ROUND_SCALE, EP_USE_UE8M0, EP_NUM_THREADS, EP_MAX_RANKS, EP_MAX_EXPERTS,
//         EP_FP8_BLOCK, EP_FP8_E4M3_MAX, EP_FP8_AMAX_FLOOR, EP_SYS_SCOPE, EP_TRACE.
//
// Protocol (pull): a rank stages its own tokens once and the receivers copy the rows they need.
//   Send half (never waits on a peer):
//     - block 0 ranks this rank's copies in (token, k) order (a shared bitmap per 128 tokens and
//       popc, see build_send_lists) and writes, in its own workspace,
//       send_slot[token*K+k] (position among this rank's copies to that expert), send_expert_offset
//       (exclusive prefix per expert) and send_list (token*K+k grouped by expert);
//     - the other blocks stage the tokens into send_x, spread over every warp so that a few tokens
//       still keep every SM busy: bf16 copied as 16-byte vectors; fp8 quantised with a half-warp
//       per 128-channel block, the fp32 scales to send_scales;
//     - the last block to finish stores, one thread per destination, with st.release,
//       dispatch_flag[parity][rank] = pack(step, num_tokens) in every rank active_ranks marks alive.
//   Receive half:
//     - thread r of every block waits for source r's flag (acquire, %globaltimer timeout from its
//       start) and takes the call's verdict on it, all sources in one round: decide_source gives
//       every block the same verdict; a source masked in active_ranks, or one that timed out (then
//       written 0 there), contributes no rows;
//     - each block reads, from every live source, how many copies it has for each local expert and
//       where they start in its send_list; a pair's rows start after the rows that earlier sources
//       sent to the same expert: the output order of reference.py (source rank, then token, then k);
//     - the rows are numbered over the grid in that order; warp w of W copies the rows numbered w
//       modulo W: one load per lane finds the source tokens of its next 32 rows, then each row (and
//       its scales; packed to UE8M0 when asked) is copied from the source's send_x into
//       recv_x[e_l][row];
//     - block 0 writes recv_range and recv_count (the handle combine reads); the last block to
//       finish stores step into state.dispatch_step[parity].
// Epoch: step = state.dispatch_step[parity] + 1, read by every block at entry; nothing but device
//        memory carries state between calls, so a captured graph replays correctly.
// Residency: a block that finished its send part waits for every source's last block, its own
//        kernel's included, so all blocks of all ranks' kernels must be resident at once: the
//        Buffer's num_sms budget (one block per SM) guarantees it.
// Reuse: the staged rows of parity p are rewritten two calls later, after every receiver finished
//        reading them (each receiver's combine of this call precedes our next dispatch's combine).
#include <cuda_bf16.h>

#include "common.cuh"
#include "fp8.cuh"
#include "layout.cuh"
#include "signal.cuh"
#include "trace.cuh"

static_assert(EP_NUM_THREADS % 32 == 0 && EP_NUM_THREADS <= 1024, "EP_NUM_THREADS must be whole warps, <= 1024");
static_assert(EP_MAX_RANKS <= EP_NUM_THREADS, "one thread decides per source rank");
static_assert(EP_FP8_BLOCK == 128, "a 128-channel scale block is 16 lanes of 8 channels");

namespace ep {

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;
constexpr int kNumWarps = EP_NUM_THREADS / kWarpSize;
constexpr int kChannelsPerVector = 8;  // bf16 channels in one 16-byte vector

// Block 0: slots, per-expert prefix and the expert-grouped list of this rank's copies.
//
// slot(t, k) = the number of copies to expert e = topk[t][k] that come before (t, k) in (token, k)
// order. Tokens are ranked kListTokens at a time: every copy sets bit t of its expert's row in a
// shared bitmap, then finds its slot with popc of the bits below t, plus the running count of the
// expert from earlier chunks: all threads at once, no serial pass. A token that names one expert
// twice (never a router's choice, but legal) shares a bit with itself, so a chunk holding such a
// token is ranked serially instead, by one warp with __match_any_sync in (token, k) order.
constexpr int kListTokens = 128;
constexpr int kListWords = kListTokens / kWarpSize;  // bitmap words per expert row
constexpr int kScanChunk = kListTokens * EP_MAX_TOPK;  // copies of one chunk, staged in shared memory
static_assert(kListTokens % kWarpSize == 0, "a bitmap row is whole words");

// One warp ranks a chunk's copies (s_chunk: experts in, slots out) in order; s_counts running.
__device__ __forceinline__ void rank_chunk_serially(int* s_chunk, int chunk_size, int* s_counts) {
    const int lane = threadIdx.x % kWarpSize;
    const unsigned lanes_below = (1u << lane) - 1u;
    for (int base = 0; base < chunk_size; base += kWarpSize) {
        const int i = base + lane;
        const int expert = i < chunk_size ? s_chunk[i] : -1;
        // Lanes without an expert get a key no other lane has, so they never group together.
        const unsigned peers = __match_any_sync(kFullMask, expert >= 0 ? expert : -1 - lane);
        const int slot = expert >= 0 ? s_counts[expert] + __popc(peers & lanes_below) : -1;
        __syncwarp();
        if (expert >= 0 && lane == 31 - __clz(peers)) s_counts[expert] += __popc(peers);
        if (i < chunk_size) s_chunk[i] = slot;
        __syncwarp();
    }
}

__device__ void build_send_lists(const Layout& layout, uint8_t* workspace, int parity, const void* topk_idx,
                                 int topk_is_int64, int num_tokens, int num_topk, int* s_counts, int* s_chunk,
                                 uint32_t* s_bits, int* s_flag, int* s_scratch) {
    const int warp = threadIdx.x / kWarpSize;
    const int num_experts = static_cast<int>(layout.num_experts);
    int* send_slot = at<int>(workspace, layout.send_slot[parity]);
    int* send_list = at<int>(workspace, layout.send_list[parity]);
    int* send_expert_offset = at<int>(workspace, layout.send_expert_offset[parity]);
    const int num_copies = num_tokens * num_topk;

    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_counts[e] = 0;
    for (int first_token = 0; first_token < num_tokens; first_token += kListTokens) {
        const int chunk_tokens = min(kListTokens, num_tokens - first_token);
        const int chunk_size = chunk_tokens * num_topk, chunk = first_token * num_topk;
        __syncthreads();  // the previous chunk is done with s_chunk, s_bits and s_flag
        for (int i = threadIdx.x; i < chunk_size; i += blockDim.x)
            s_chunk[i] = read_expert(topk_idx, topk_is_int64, chunk + i, num_experts);
        for (int w = threadIdx.x; w < num_experts * kListWords; w += blockDim.x) s_bits[w] = 0u;
        if (threadIdx.x == 0) *s_flag = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < chunk_size; i += blockDim.x) {
            const int expert = s_chunk[i];
            if (expert < 0) continue;
            const int token = i / num_topk, k = i - token * num_topk;
            for (int other = i - k; other < i; ++other)
                if (s_chunk[other] == expert) *s_flag = 1;  // a repeated expert: rank serially
            atomicOr(s_bits + expert * kListWords + token / kWarpSize, 1u << (token % kWarpSize));
        }
        __syncthreads();
        if (*s_flag) {
            if (warp == 0) rank_chunk_serially(s_chunk, chunk_size, s_counts);
            __syncthreads();
            for (int i = threadIdx.x; i < chunk_size; i += blockDim.x) send_slot[chunk + i] = s_chunk[i];
            continue;
        }
        for (int i = threadIdx.x; i < chunk_size; i += blockDim.x) {
            const int expert = s_chunk[i];
            int slot = -1;
            if (expert >= 0) {
                const int token = i / num_topk;
                const uint32_t* row = s_bits + expert * kListWords;
                slot = s_counts[expert] + __popc(row[token / kWarpSize] & ((1u << (token % kWarpSize)) - 1u));
                for (int w = 0; w < token / kWarpSize; ++w) slot += __popc(row[w]);
            }
            send_slot[chunk + i] = slot;
        }
        __syncthreads();  // every slot read the counts before they move on
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            int count = 0;
#pragma unroll
            for (int w = 0; w < kListWords; ++w) count += __popc(s_bits[e * kListWords + w]);
            s_counts[e] += count;
        }
    }
    __syncthreads();
    const int total = block_exclusive_scan(s_counts, num_experts, s_scratch);
    if (threadIdx.x == 0) s_counts[num_experts] = total;
    __syncthreads();
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) send_expert_offset[e] = s_counts[e];
    // send_slot was written by this block above: visible to it after the barrier.
    for (int i = threadIdx.x; i < num_copies; i += blockDim.x) {
        const int expert = read_expert(topk_idx, topk_is_int64, i, num_experts);
        if (expert >= 0) send_list[s_counts[expert] + send_slot[i]] = i;
    }
}

#if EP_USE_FP8
// Vectors of one token a warp quantises per item: kStageUnroll per lane, loaded before the first is
// used, so that a few tokens spread over the whole grid still cover the load latency. Four, not
// eight: the decode shape (128 tokens of 896 vectors over 15 staging blocks of 32 warps) then has
// 896 items of 128 vectors instead of 512 of 256, and its slowest warp stages 2 x 4 vectors per
// lane instead of 2 x 8 (bench, 2026-12-03: decode dispatch 56.7 -> 53.7 us, the mean of two runs each).
constexpr int kStageUnroll = 4;
constexpr int kItemVectors = kStageUnroll * kWarpSize;

// Quantises the tokens into send_x / send_scales. Work item: kItemVectors consecutive vectors of one
// token; lane l takes vectors u * 32 + l, so every load and store of a warp is one contiguous run,
// and each half-warp holds one 128-channel block (H/8 is a multiple of 16: no block straddles the
// end of a row, and lanes past it are whole half-warps that still join the shuffles, with zeros).
__device__ __forceinline__ void stage_tokens(const int4* __restrict__ x, uint8_t* send_x, float* send_scales,
                                             int64_t send_row_bytes, int num_tokens, int hidden, int global_warp,
                                             int num_warps) {
    constexpr int kLanesPerScaleBlock = EP_FP8_BLOCK / kChannelsPerVector;
    const int lane = threadIdx.x % kWarpSize;
    const int vectors_per_row = hidden / kChannelsPerVector;
    const int items_per_row = (vectors_per_row + kItemVectors - 1) / kItemVectors;
    for (int item = global_warp; item < num_tokens * items_per_row; item += num_warps) {
        const int token = item / items_per_row;  // uniform across the warp: one division per item
        const int first = (item - token * items_per_row) * kItemVectors;
        const int4* row = x + static_cast<int64_t>(token) * vectors_per_row;
        int4 vectors[kStageUnroll];
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
            const int column = first + u * kWarpSize + lane;
            vectors[u] = column < vectors_per_row ? ld_input_int4(row + column) : make_int4(0, 0, 0, 0);
        }
        uint2* q_row = reinterpret_cast<uint2*>(send_x + token * send_row_bytes);
        float* scale_row = send_scales + static_cast<int64_t>(token) * (hidden / EP_FP8_BLOCK);
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
            const int column = first + u * kWarpSize + lane;
            float values[8];
            unpack_bf16x8(vectors[u], values);
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(values[i]));
#pragma unroll
            for (int mask = kLanesPerScaleBlock / 2; mask > 0; mask /= 2)
                amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, mask));
            float scale, multiplier;
            fp8_scales(amax, EP_ROUND_SCALE, &scale, &multiplier);
            if (column < vectors_per_row) {
                q_row[column] = quantize8(values, multiplier);
                if (column % kLanesPerScaleBlock == 0) scale_row[column / kLanesPerScaleBlock] = scale;
            }
        }
    }
}
#else
// Vectors each lane loads before it stores the first: enough bytes in flight per SM to cover the
// load latency when a few tokens are spread over the whole grid.
constexpr int kStageUnroll = 8;

// Copies the tokens into send_x: 16-byte vectors spread over every thread, kStageUnroll loads in
// flight per lane.
__device__ __forceinline__ void stage_tokens(const int4* __restrict__ x, uint8_t* send_x, float* /*send_scales*/,
                                             int64_t send_row_bytes, int num_tokens, int hidden, int thread,
                                             int num_threads) {
    const int vectors_per_row = hidden / kChannelsPerVector;
    const int num_vectors = num_tokens * vectors_per_row;
    for (int base = thread; base < num_vectors; base += kStageUnroll * num_threads) {
        int4 vectors[kStageUnroll];
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
            const int v = base + u * num_threads;
            if (v < num_vectors) vectors[u] = ld_input_int4(x + v);
        }
#pragma unroll
        for (int u = 0; u < kStageUnroll; ++u) {
            const int v = base + u * num_threads;
            const int token = v / vectors_per_row, column = v - token * vectors_per_row;
            if (v < num_vectors) reinterpret_cast<int4*>(send_x + token * send_row_bytes)[column] = vectors[u];
        }
    }
}
#endif

// One warp copies one received row from the source's staging into recv_x, and its scales.
__device__ __forceinline__ void copy_row(const uint8_t* src_row, const float* src_scale_row, uint8_t* dst_row,
                                         void* dst_scale_row, int row_bytes, int num_scales) {
#if EP_USE_FP8
    const int lane = threadIdx.x % kWarpSize;
    // The scales first: their loads then overlap the row's.
#if EP_USE_UE8M0
    // Four exponent bytes to a word, byte j % 4 of word j / 4 for scale block j.
    const int num_words = (num_scales + 3) / 4;
    for (int w = lane; w < num_words; w += kWarpSize) {
        uint32_t word = 0u;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int j = 4 * w + b;
            if (j < num_scales) word |= ue8m0_byte(ld_cg_float(src_scale_row + j)) << (8 * b);
        }
        st_once(static_cast<uint32_t*>(dst_scale_row) + w, word);
    }
#else
    for (int j = lane; j < num_scales; j += kWarpSize) st_once(static_cast<float*>(dst_scale_row) + j, ld_cg_float(src_scale_row + j));
#endif
#endif
    warp_copy<true>(reinterpret_cast<const int4*>(src_row), reinterpret_cast<int4*>(dst_row),
              row_bytes / static_cast<int>(sizeof(int4)));
}

}  // namespace ep

using namespace ep;

extern "C" __global__ void __launch_bounds__(EP_NUM_THREADS, 1)
ll_dispatch(int phases, int parity, const Layout* __restrict__ layout_ptr, uint8_t* workspace, int rank,
            const int4* __restrict__ x, int num_tokens, const void* __restrict__ topk_idx, int topk_is_int64,
            int num_topk, int* active_ranks, uint8_t* recv_x, void* recv_scales, int* recv_count,
            long long timeout_ns) {
    __shared__ int s_counts[EP_MAX_EXPERTS + 1];  // send: per-expert counts; recv: rows per (e_l, src)
    __shared__ int s_start[EP_MAX_EXPERTS];       // recv: first send_list entry per (e_l, src)
    // recv: first received row per (e_l, src), all experts; send: a chunk of the copies being ranked
    __shared__ int s_flat[kScanChunk > EP_MAX_EXPERTS ? kScanChunk : EP_MAX_EXPERTS];
    __shared__ uint32_t s_bits[EP_MAX_EXPERTS * kListWords];  // send: tokens of each expert, one chunk; recv: s_base
    __shared__ int s_scratch[kWarpSize + 1];
    __shared__ int s_verdict[EP_MAX_RANKS];  // recv: decide_source of every source
    __shared__ int s_flag;
    __shared__ int s_is_last;

    const Layout& layout = *layout_ptr;
    State* state = at<State>(workspace, layout.state);
    const uint64_t* route = at<uint64_t>(workspace, layout.route);
    const uint32_t step = state->dispatch_step[parity] + 1u;
    const int num_ranks = static_cast<int>(layout.num_ranks);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int hidden = static_cast<int>(layout.hidden);
    const int num_scales = static_cast<int>(layout.num_scales);

    if (phases & kPhaseSend) {
        EP_TRACE_POINT(0);
        // Block 0 builds the lists (and, when the grid has one block, then stages too); the other
        // blocks stage.
        if (blockIdx.x == 0)
            build_send_lists(layout, workspace, parity, topk_idx, topk_is_int64, num_tokens, num_topk, s_counts, s_flat,
                             s_bits, &s_flag, s_scratch);
        if (blockIdx.x > 0 || gridDim.x == 1) {
            const int num_stage_blocks = gridDim.x > 1 ? gridDim.x - 1 : 1;
            const int stage_block = gridDim.x > 1 ? blockIdx.x - 1 : 0;
#if EP_USE_FP8
            stage_tokens(x, at<uint8_t>(workspace, layout.send_x[parity]), at<float>(workspace, layout.send_scales[parity]),
                         layout.send_row_bytes, num_tokens, hidden, stage_block * kNumWarps + warp,
                         num_stage_blocks * kNumWarps);
#else
            stage_tokens(x, at<uint8_t>(workspace, layout.send_x[parity]), nullptr, layout.send_row_bytes, num_tokens,
                         hidden, stage_block * EP_NUM_THREADS + threadIdx.x, num_stage_blocks * EP_NUM_THREADS);
#endif
        }
        EP_TRACE_POINT(1);
        // Every block's staging and the lists are ordered before the release stores.
        if (finish_block(&state->dispatch_send_done[parity], &s_is_last)) {
            signal_ranks(route, layout.dispatch_flag, parity * EP_MAX_RANKS + rank, num_ranks, active_ranks,
                         pack_flag(step, static_cast<uint32_t>(num_tokens)));
            EP_TRACE_POINT(2);
        }
    }

    if (phases & kPhaseRecv) {
        EP_TRACE_POINT(3);
        const int num_local_experts = static_cast<int>(layout.num_local_experts);
        const int64_t num_rows_per_expert = static_cast<int64_t>(num_ranks) * layout.num_max_tokens;
        uint64_t* verdicts = at<uint64_t>(workspace, layout.dispatch_verdict) + parity * EP_MAX_RANKS;
        const uint64_t* flags = at<uint64_t>(workspace, layout.dispatch_flag) + parity * EP_MAX_RANKS;
        int2* recv_range = at<int2>(workspace, layout.recv_range[parity]);
        // The send half's bitmap is free now: it holds each pair's first row inside its expert.
        int* s_base = reinterpret_cast<int*>(s_bits);
        const int out_row_bytes = EP_USE_FP8 ? hidden : hidden * 2;
        const int out_scale_stride = EP_USE_UE8M0 ? (num_scales + 3) / 4 : num_scales;
        const int num_warps_total = gridDim.x * kNumWarps;
        const int global_warp = blockIdx.x * kNumWarps + warp;

        // Every source at once, a thread each: its wait and the call's verdict on it, in one round.
        if (threadIdx.x < num_ranks)
            s_verdict[threadIdx.x] = decide_source(verdicts + threadIdx.x, flags + threadIdx.x, step, active_ranks,
                                                   threadIdx.x, timeout_ns, global_timer_ns());
        __syncthreads();
        EP_TRACE_POINT(4);

        // (source, local expert) pairs, source-major: counts from each source's own prefix; the
        // first row of a pair inside its expert after the rows of the sources before it.
        const int num_pairs = num_ranks * num_local_experts;
        for (int i = threadIdx.x; i < num_pairs; i += blockDim.x) {
            const int src = i / num_local_experts, local_expert = i - src * num_local_experts;
            int count = 0, start = 0;
            if (s_verdict[src] == kSourceLive) {
                const int* offsets = reinterpret_cast<const int*>(route[src] + layout.send_expert_offset[parity]);
                const int expert = rank * num_local_experts + local_expert;
                start = ld_cg_int(offsets + expert);
                count = ld_cg_int(offsets + expert + 1) - start;
            }
            s_counts[i] = count;
            s_start[i] = start;
            s_flat[i] = count;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < num_local_experts; e += blockDim.x) {
            int rows = 0;
            for (int src = 0; src < num_ranks; ++src) {
                const int i = src * num_local_experts + e;
                s_base[i] = rows;
                rows += s_counts[i];
                if (blockIdx.x == 0) recv_range[e * num_ranks + src] = make_int2(s_base[i], s_counts[i]);
            }
            if (blockIdx.x == 0) recv_count[e] = rows;
        }
        // The scan's barriers also publish s_base to the block.
        const int num_rows = block_exclusive_scan(s_flat, num_pairs, s_scratch);
        EP_TRACE_POINT(5);

        // Rows are numbered n over the whole grid in pair order: warp g copies the rows whose number
        // is g modulo the grid's warps. Lane j looks up the warp's row base + j * num_warps_total.
        for (int base = global_warp; base < num_rows; base += kWarpSize * num_warps_total) {
            const int my_n = base + lane * num_warps_total;
            int my_src = 0, my_token = 0;
            int64_t my_out_row = 0;
            if (my_n < num_rows) {
                const int pair = upper_bound(s_flat, num_pairs, my_n) - 1;
                const int local_expert = pair % num_local_experts;
                const int j = my_n - s_flat[pair];
                my_src = pair / num_local_experts;
                const int* send_list = reinterpret_cast<const int*>(route[my_src] + layout.send_list[parity]);
                my_token = ld_cg_int(send_list + s_start[pair] + j) / num_topk;
                my_out_row = local_expert * num_rows_per_expert + s_base[pair] + j;
            }
            const int rows_here = min(kWarpSize, (num_rows - base + num_warps_total - 1) / num_warps_total);
            for (int i = 0; i < rows_here; ++i) {
                const int src = __shfl_sync(kFullMask, my_src, i);
                const int token = __shfl_sync(kFullMask, my_token, i);
                const int64_t out_row = __shfl_sync(kFullMask, my_out_row, i);
                const uint8_t* src_row = reinterpret_cast<const uint8_t*>(route[src] + layout.send_x[parity]) +
                                         token * layout.send_row_bytes;
                const float* src_scales = reinterpret_cast<const float*>(route[src] + layout.send_scales[parity]) +
                                          static_cast<int64_t>(token) * num_scales;
                void* out_scales = EP_USE_FP8 ? static_cast<void*>(static_cast<uint8_t*>(recv_scales) +
                                                                  out_row * out_scale_stride * 4)
                                              : nullptr;
                copy_row(src_row, src_scales, recv_x + out_row * out_row_bytes, out_scales, out_row_bytes, num_scales);
            }
        }
        EP_TRACE_POINT(6);
        if (finish_block(&state->dispatch_recv_done[parity], &s_is_last) && threadIdx.x == 0) {
            state->dispatch_step[parity] = step;
            EP_TRACE_POINT(7);
        }
    }
}
