// ll_dispatch.cu: low-latency dispatch. One launch runs both halves (phases = send | receive); the
// hook mode launches the send half now and the receive half in hook().
// Macros: EP_USE_FP8, EP_ROUND_SCALE, EP_USE_UE8M0, EP_NUM_THREADS, EP_MAX_RANKS, EP_MAX_EXPERTS,
//         EP_FP8_BLOCK, EP_FP8_E4M3_MAX, EP_FP8_AMAX_FLOOR, EP_SYS_SCOPE, EP_TRACE.
//
// Protocol (pull): a rank stages its own tokens once and the receivers copy the rows they need.
//   Send half (never waits on a peer):
//     - block 0 counts this rank's copies per expert and writes send_expert_offset (the exclusive
//       prefix), then stores, one thread per destination, with st.release,
//       dispatch_flag[parity][rank] = pack(step, target) in every rank active_ranks marks alive: the
//       routing flag, out ~2 us into the call. target is the value state.dispatch_staged reaches once
//       this call's send half is out (below);
//     - block 0 then ranks the copies in (token, k) order (a shared bitmap per 128 tokens and popc,
//       see build_send_lists) and writes send_slot[token*K+k] (position among this rank's copies to
//       that expert) and send_list (the token of each copy, grouped by expert: a receiver needs no
//       K of its source, which may differ from its own). recv_x holds T rows per (expert,
//       source): copies past a source's first T to one expert (only tokens naming an expert twice
//       make them) are dropped, slot -1, as -1 entries are;
//     - the other blocks stage the tokens into send_x, spread over their staging warps so that a few
//       tokens still keep every SM busy: bf16 copied as 16-byte vectors; fp8 quantised with a
//       half-warp per 128-channel block, the fp32 scales to send_scales;
//     - block 0 after its lists, and every staging warp after its rows, adds 1 to
//       state.dispatch_staged[parity] with release semantics (a running count, never reset).
//   Receive half:
//     - the planning warp (the block's last warp; in a launch of both halves it works while the
//       other warps stage) waits, lane r for source r, for the routing flag (acquire, %globaltimer
//       timeout from its start) and takes the call's verdict on it: decide_source gives every block
//       the same verdict; a source masked in active_ranks, or one that timed out (then written 0
//       there), contributes no rows;
//     - it reads, from every live source, how many copies it has for each local expert and where
//       they start in its send_list; a pair's rows start after the rows that earlier sources sent to
//       the same expert: the output order of reference.py (source rank, then token, then k);
//     - then thread r of the block waits for source r's dispatch_staged to reach its target: its
//       lists and every staged row are then readable. A live source whose count does not get there
//       in time (it stopped after its routing flag) is masked, and its rows, already counted, are
//       written as zeros (fp8: scale 0). Each block decides this for its own rows: a count that
//       lands just as the timeout passes can leave some blocks' rows of that source copied and
//       others' zero (the counts are the same either way). A block that finds a source so sets its
//       bit in state.dispatch_unstaged[parity];
//     - the rows are numbered over the grid in pair order; warp w of W copies the rows numbered w
//       modulo W from the source's send_x into recv_x[e_l][row], and their scales (packed to UE8M0
//       when asked) into recv_scales[e_l][row] (the caller's array's strides are kernel arguments).
//       Scale column stride 1 (row-major, or DeepEP's with one row an expert) and bf16: one load per
//       lane finds the source tokens of the warp's next 32 rows, and each row's warp copies its
//       scales. Any other stride (DeepEP's column-major view, or one scale column, stride 0): the
//       block looks up the rows of its next 32 rounds together into shared memory, and in each
//       round its warps store the scales of the round's 16 neighbouring rows together, a column of
//       the 16 rows per half-warp store;
//     - block 0 writes recv_range and recv_count (the handle combine reads); the last block to
//       finish sets to 0 the rows in recv_range of every source a block found unstaged, clears those
//       bits, and stores step into state.dispatch_step[parity]. The zero rows stay counted in
//       recv_count (some blocks may have copied theirs), but no combine reads them back for their
//       tokens, even one that finds the source live again: the reference's rows of a masked source.
// Epoch: step = next_step(state.dispatch_step[parity]), read by every block at entry; nothing but device
//        memory carries state between calls, so a captured graph replays correctly. The staging
//        count needs none: each call's target is past every earlier call's.
// Residency: a block that finished its send part waits for every source's blocks, its own
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
static_assert(EP_MAX_RANKS <= EP_NUM_THREADS, "one thread waits per source rank");
static_assert(EP_MAX_RANKS <= 64, "state.dispatch_unstaged holds a bit per source rank");
static_assert(EP_NUM_THREADS >= 2 * 32, "a block of both halves has a planning warp and at least one staging warp");
static_assert(EP_FP8_BLOCK == 128, "a 128-channel scale block is 16 lanes of 8 channels");
static_assert(EP_NUM_THREADS <= 768, "the receive half's row window (4 ints a thread) and the rest of the shared "
                                     "memory fit the 48 KB of static shared memory up to 768 threads a block");

namespace ep {

constexpr int kPhaseSend = 1;
constexpr int kPhaseRecv = 2;
constexpr int kNumWarps = EP_NUM_THREADS / kWarpSize;
constexpr int kChannelsPerVector = 8;  // bf16 channels in one 16-byte vector

// Block 0: the per-expert prefix, published at once by the routing flag, then the slots and the
// expert-grouped list of this rank's copies.
//
// slot(t, k) = the number of copies to expert e = topk[t][k] that come before (t, k) in (token, k)
// order; -1 from T on (recv_x's rows per source: the host checks host ids, never device ones).
// Tokens are ranked kListTokens at a time: every copy sets bit t of its expert's row in a shared
// bitmap, then finds its slot with popc of the bits below t, plus the running count of the expert
// from earlier chunks: all threads at once, no serial pass. A token that names one expert
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

// Every thread of block 0 calls it; it ends with a barrier, after which the block's writes of
// send_slot and send_list are done (the caller then publishes them).
__device__ void build_send_lists(const Layout& layout, uint8_t* workspace, const uint64_t* route, int parity, int rank,
                                 uint32_t step, uint32_t staged_target, const int* active_ranks, const void* topk_idx,
                                 int topk_is_int64, int num_tokens, int num_topk, int* s_offset, int* s_running,
                                 int* s_chunk, uint32_t* s_bits, int* s_flag, int* s_scratch) {
    const int warp = threadIdx.x / kWarpSize;
    const int num_experts = static_cast<int>(layout.num_experts);
    int* send_slot = at<int>(workspace, layout.send_slot[parity]);
    int* send_list = at<int>(workspace, layout.send_list[parity]);
    int* send_expert_offset = at<int>(workspace, layout.send_expert_offset[parity]);
    const int num_copies = num_tokens * num_topk;
    const int num_max_tokens = static_cast<int>(layout.num_max_tokens);

    // Copies per expert and their prefix, then the routing flag: receivers plan from the prefix
    // while the slots, the list and the staging are still being written.
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_offset[e] = s_running[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < num_copies; i += blockDim.x) {
        const int expert = read_expert(topk_idx, topk_is_int64, i, num_experts);
        if (expert >= 0) atomicAdd(s_offset + expert, 1);
    }
    __syncthreads();
    // No barrier after the clamp: block_exclusive_scan reads entry e in the thread that wrote it.
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) s_offset[e] = min(s_offset[e], num_max_tokens);
    EP_TRACE_POINT(9);
    const int total = block_exclusive_scan(s_offset, num_experts, s_scratch);
    if (threadIdx.x == 0) s_offset[num_experts] = total;
    __syncthreads();
    for (int e = threadIdx.x; e <= num_experts; e += blockDim.x) send_expert_offset[e] = s_offset[e];
    __syncthreads();  // every thread's offsets are ordered before the release stores
    EP_TRACE_POINT(10);
    signal_ranks(route, layout.dispatch_flag, parity * EP_MAX_RANKS + rank, static_cast<int>(layout.num_ranks),
                 active_ranks, pack_flag(step, staged_target));
    EP_TRACE_POINT(2);

    for (int first_token = 0; first_token < num_tokens; first_token += kListTokens) {
        const int chunk_tokens = min(kListTokens, num_tokens - first_token);
        const int chunk_size = chunk_tokens * num_topk, chunk = first_token * num_topk;
        __syncthreads();  // the previous chunk is done with s_chunk, s_bits and s_flag
        for (int i = threadIdx.x; i < chunk_size; i += blockDim.x)
            s_chunk[i] = read_expert(topk_idx, topk_is_int64, chunk + i, num_experts);
        for (int w = threadIdx.x; w < num_experts * kListWords; w += blockDim.x) s_bits[w] = 0u;
        if (threadIdx.x == 0) *s_flag = 0;
        __syncthreads();
        EP_TRACE_POINT(11);
        for (int i = threadIdx.x; i < chunk_size; i += blockDim.x) {
            const int expert = s_chunk[i];
            if (expert < 0) continue;
            const int token = i / num_topk, k = i - token * num_topk;
            for (int other = i - k; other < i; ++other)
                if (s_chunk[other] == expert) *s_flag = 1;  // a repeated expert: rank serially
            atomicOr(s_bits + expert * kListWords + token / kWarpSize, 1u << (token % kWarpSize));
        }
        __syncthreads();
        EP_TRACE_POINT(12);
        if (*s_flag) {
            if (warp == 0) rank_chunk_serially(s_chunk, chunk_size, s_running);
            __syncthreads();
            for (int i = threadIdx.x; i < chunk_size; i += blockDim.x) {
                const int slot = s_chunk[i] < num_max_tokens ? s_chunk[i] : -1;
                send_slot[chunk + i] = slot;
                if (slot >= 0)
                    send_list[s_offset[read_expert(topk_idx, topk_is_int64, chunk + i, num_experts)] + slot] =
                        first_token + i / num_topk;
            }
            EP_TRACE_POINT(13);
            continue;
        }
        for (int i = threadIdx.x; i < chunk_size; i += blockDim.x) {
            const int expert = s_chunk[i];
            int slot = -1;
            if (expert >= 0) {
                const int token = i / num_topk;
                const uint32_t* row = s_bits + expert * kListWords;
                slot = s_running[expert] + __popc(row[token / kWarpSize] & ((1u << (token % kWarpSize)) - 1u));
                for (int w = 0; w < token / kWarpSize; ++w) slot += __popc(row[w]);
                // Past T only after an earlier chunk named an expert twice in a token.
                if (slot < num_max_tokens) send_list[s_offset[expert] + slot] = first_token + token;
                else slot = -1;
            }
            send_slot[chunk + i] = slot;
        }
        __syncthreads();  // every slot read the running counts before they move on
        EP_TRACE_POINT(13);
        for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
            int count = 0;
#pragma unroll
            for (int w = 0; w < kListWords; ++w) count += __popc(s_bits[e * kListWords + w]);
            s_running[e] += count;
        }
    }
    __syncthreads();
}

// The planning warp of a receiving block: every source's verdict (lane r for source r), then the
// plan in shared memory. Per (source, local expert) pair, source-major: its rows (s_counts, and
// s_flat, scanned into the pair's first row in the grid's numbering), its first send_list entry
// (s_start) and its first row inside its expert (s_base); s_target: the staging count each live
// source announced. Block 0 also writes recv_range and recv_count. Returns the rows to copy, in
// every lane; the arrays are visible to the block after its next barrier.
constexpr int kPlanLoads = 8;  // offsets a lane loads before it stores the first
__device__ int plan_receive(const Layout& layout, uint8_t* workspace, const uint64_t* route, int parity, int rank,
                            bool sends_in_launch, uint32_t step, int* active_ranks, int64_t timeout_ns,
                            uint64_t start_ns, int* recv_count,
                            int* s_verdict, uint32_t* s_target, int* s_counts, int* s_start, int* s_flat, int* s_base,
                            int* s_offsets) {
    const int lane = threadIdx.x % kWarpSize;
    const int num_ranks = static_cast<int>(layout.num_ranks);
    const int num_local_experts = static_cast<int>(layout.num_local_experts);
    uint64_t* verdicts = at<uint64_t>(workspace, layout.dispatch_verdict) + parity * EP_MAX_RANKS;
    const uint64_t* flags = at<uint64_t>(workspace, layout.dispatch_flag) + parity * EP_MAX_RANKS;
    int2* recv_range = at<int2>(workspace, layout.recv_range[parity]);

    for (int src = lane; src < num_ranks; src += kWarpSize) {
        const int verdict = decide_source(verdicts + src, flags + src, step, active_ranks, src,
                                          peer_timeout_ns(src, rank, sends_in_launch, timeout_ns), start_ns);
        s_verdict[src] = verdict;
        // A live verdict was taken on this step's flag, which stays until our next call on this parity.
        s_target[src] = verdict == kSourceLive ? flag_payload(ld_acquire_sys(flags + src)) : 0u;
    }
    __syncwarp();
    EP_TRACE_POINT_WARP(4);

    // Each live source's prefix over this rank's experts (E_l + 1 entries; zeros for the others),
    // kPlanLoads loads in flight per lane: one round trip, not one per pair.
    const int offsets_per_source = num_local_experts + 1;
    const int num_offsets = num_ranks * offsets_per_source;
    for (int base = 0; base < num_offsets; base += kPlanLoads * kWarpSize) {
        int values[kPlanLoads];
#pragma unroll
        for (int u = 0; u < kPlanLoads; ++u) {
            const int i = base + u * kWarpSize + lane;
            const int src = i / offsets_per_source;
            values[u] = 0;
            if (i < num_offsets && s_verdict[src] == kSourceLive) {
                const int* offsets = reinterpret_cast<const int*>(route[src] + layout.send_expert_offset[parity]);
                values[u] = ld_cg_int(offsets + rank * num_local_experts + i - src * offsets_per_source);
            }
        }
#pragma unroll
        for (int u = 0; u < kPlanLoads; ++u) {
            const int i = base + u * kWarpSize + lane;
            if (i < num_offsets) s_offsets[i] = values[u];
        }
    }
    __syncwarp();
    EP_TRACE_POINT_WARP(14);
    const int num_pairs = num_ranks * num_local_experts;
    for (int i = lane; i < num_pairs; i += kWarpSize) {
        const int src = i / num_local_experts;
        const int* offsets = s_offsets + src * offsets_per_source + (i - src * num_local_experts);
        s_start[i] = offsets[0];
        s_counts[i] = s_flat[i] = offsets[1] - offsets[0];
    }
    __syncwarp();
    for (int e = lane; e < num_local_experts; e += kWarpSize) {
        int rows = 0;
        for (int src = 0; src < num_ranks; ++src) {
            const int i = src * num_local_experts + e;
            s_base[i] = rows;
            rows += s_counts[i];
            if (blockIdx.x == 0) recv_range[e * num_ranks + src] = make_int2(s_base[i], s_counts[i]);
        }
        if (blockIdx.x == 0) recv_count[e] = rows;
    }
    const int num_rows = warp_exclusive_scan(s_flat, num_pairs);
    EP_TRACE_POINT_WARP(5);
    return num_rows;
}

#if EP_USE_FP8
// Vectors of one token a warp quantises per item: kStageUnroll per lane, loaded before the first is
// used, so that a few tokens spread over the whole grid still cover the load latency. Four, not
// eight: the decode shape (128 tokens of 896 vectors) then has 896 items of 128 vectors instead of
// 512 of 256, spread more evenly over the staging warps (bench, 2026-12-03: decode dispatch 56.7 ->
// 53.7 us, the mean of two runs each). With 15 staging warps a block each warp takes ~4 items, one
// after the other; loading the next one or three before quantising was slower (docs/performance.md,
// (16)): the phase is bound by HBM bytes, not by a warp's latency.
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

// One 4-byte scale word of a received row's scales with column stride 1 (row-major; other strides
// take copy_scale_slice, below). One warp writes a row's words at once: streamed, as the rows are (whole
// sectors where a row's words are a multiple of 8: fp32 scales of a hidden size that is a multiple
// of 1024; UE8M0 rows at 7168, 14 words, share their edge sectors with the neighbouring rows, not
// measured apart).
template <typename T>
__device__ __forceinline__ void store_scale(T* dst_scale_row, int column, T value) {
    st_once(dst_scale_row + column, value);
}

// One warp copies one received row from the source's staging into recv_x, and its num_scales
// scales, row-major at dst_scale_row (none: num_scales 0).
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
        store_scale(static_cast<uint32_t*>(dst_scale_row), w, word);
    }
#else
    for (int j = lane; j < num_scales; j += kWarpSize)
        store_scale(static_cast<float*>(dst_scale_row), j, ld_cg_float(src_scale_row + j));
#endif
#endif
    warp_copy<true>(reinterpret_cast<const int4*>(src_row), reinterpret_cast<int4*>(dst_row),
              row_bytes / static_cast<int>(sizeof(int4)));
}

// One warp writes a received row, and its num_scale_columns row-major scale words, as zeros: the row
// of a source that stopped after its routing flag (counted, never staged). fp8 scale 0 (UE8M0 byte 0)
// dequantises to 0 as well.
__device__ __forceinline__ void zero_row(uint8_t* dst_row, void* dst_scale_row, int row_bytes, int num_scale_columns) {
    const int lane = threadIdx.x % kWarpSize;
    if (EP_USE_FP8)
        for (int w = lane; w < num_scale_columns; w += kWarpSize)
            store_scale(static_cast<uint32_t*>(dst_scale_row), w, 0u);
    for (int v = lane; v < row_bytes / static_cast<int>(sizeof(int4)); v += kWarpSize)
        st_once(reinterpret_cast<int4*>(dst_row) + v, make_int4(0, 0, 0, 0));
}

// Slice `slice` of a received row's scales, column stride scale_column_stride (DeepEP's column-major
// layout): fp32, the 4 columns 4 slice .. 4 slice + 3 (those below num_scales); UE8M0, word `slice`,
// packed from the same 4 scales. src_scale_row null: the row of an unstaged source, scale 0.
// Plain stores, not streamed: a sector holds a column of 8 rows, which other half-warps complete;
// streamed (evict-first), partial sectors left L2 alone (+7.9 us on an H100 decode dispatch,
// docs/performance.md (52)).
__device__ __forceinline__ void copy_scale_slice(const float* src_scale_row, uint32_t* dst_scale_row, int slice,
                                                 int num_scales, int scale_column_stride) {
    const int first = 4 * slice;
    float values[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (src_scale_row != nullptr) {
        if (num_scales % 4 == 0) {  // the staged rows are then 16-byte aligned
            const float4 v = __ldcg(reinterpret_cast<const float4*>(src_scale_row + first));
            values[0] = v.x, values[1] = v.y, values[2] = v.z, values[3] = v.w;
        } else {
#pragma unroll
            for (int b = 0; b < 4; ++b)
                if (first + b < num_scales) values[b] = ld_cg_float(src_scale_row + first + b);
        }
    }
#if EP_USE_UE8M0
    uint32_t word = 0u;
#pragma unroll
    for (int b = 0; b < 4; ++b)
        if (first + b < num_scales) word |= ue8m0_byte(values[b]) << (8 * b);
    dst_scale_row[static_cast<int64_t>(slice) * scale_column_stride] = word;
#else
#pragma unroll
    for (int b = 0; b < 4; ++b)
        if (first + b < num_scales)
            dst_scale_row[static_cast<int64_t>(first + b) * scale_column_stride] = __float_as_uint(values[b]);
#endif
}

}  // namespace ep

using namespace ep;

extern "C" __global__ void __launch_bounds__(EP_NUM_THREADS, 1)
ll_dispatch(int phases, int parity, const Layout* __restrict__ layout_ptr, uint8_t* workspace, int rank,
            const int4* __restrict__ x, int num_tokens, const void* __restrict__ topk_idx, int topk_is_int64,
            int num_topk, int* active_ranks, uint8_t* recv_x, void* recv_scales, int scale_row_stride,
            int scale_column_stride, int* recv_count, long long timeout_ns) {
    // send: block 0's per-expert prefix; recv: rows per (source, local expert) pair
    __shared__ int s_counts[EP_MAX_EXPERTS + 1];
    __shared__ int s_start[EP_MAX_EXPERTS];  // send: block 0's running counts; recv: first send_list entry per pair
    // send: a chunk of block 0's copies being ranked; recv: each pair's first row over the grid
    __shared__ int s_flat[kScanChunk > EP_MAX_EXPERTS ? kScanChunk : EP_MAX_EXPERTS];
    // send: block 0's tokens of each expert, one chunk; recv: s_base, then the sources' prefixes
    __shared__ uint32_t s_bits[EP_MAX_EXPERTS * kListWords];
    __shared__ int s_scratch[kWarpSize + 1];
    __shared__ int s_verdict[EP_MAX_RANKS];   // recv: decide_source of every source
    __shared__ uint32_t s_target[EP_MAX_RANKS];  // recv: the staging count each live source announced
    __shared__ int s_staged[EP_MAX_RANKS];    // recv: the source's rows are readable (else written as zeros)
    __shared__ int s_num_rows;
    __shared__ int s_flag;
    __shared__ int s_is_last;
    __shared__ int s_any_unstaged;  // recv, last block: some block found a live source unstaged
    static_assert(EP_MAX_EXPERTS * kListWords >= 2 * EP_MAX_EXPERTS + EP_MAX_RANKS,
                  "s_bits holds the pairs' bases and every source's prefix");

    const Layout& layout = *layout_ptr;
    State* state = at<State>(workspace, layout.state);
    const uint64_t* route = at<uint64_t>(workspace, layout.route);
    const uint32_t step = next_step(state->dispatch_step[parity]);
    const int num_ranks = static_cast<int>(layout.num_ranks);
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    const int hidden = static_cast<int>(layout.hidden);
    const int num_scales = static_cast<int>(layout.num_scales);
    // In a launch of both halves the last warp plans the receive half while the others stage.
    constexpr int kPlanWarp = kNumWarps - 1;
    const int num_stage_warps = (phases & kPhaseRecv) ? kNumWarps - 1 : kNumWarps;

    if (phases & kPhaseSend) {
        EP_TRACE_POINT(0);
        // Block 0 builds the lists (and, when the grid has one block, then stages too); the other
        // blocks stage. Block 0 after its lists, and every staging warp after its rows, adds 1 to
        // dispatch_staged: target is the count after this call's.
        const int num_stage_blocks = gridDim.x > 1 ? gridDim.x - 1 : 1;
        if (blockIdx.x == 0) {
            const uint32_t staged_target =
                state->dispatch_staged_target[parity] + 1u + static_cast<uint32_t>(num_stage_blocks * num_stage_warps);
            build_send_lists(layout, workspace, route, parity, rank, step, staged_target, active_ranks, topk_idx,
                             topk_is_int64, num_tokens, num_topk, s_counts, s_start, s_flat, s_bits, &s_flag,
                             s_scratch);
            if (threadIdx.x == 0) {
                state->dispatch_staged_target[parity] = staged_target;
                red_add_release(&state->dispatch_staged[parity], 1u);
            }
            EP_TRACE_POINT(1);
        }
        if ((blockIdx.x > 0 || gridDim.x == 1) && warp < num_stage_warps) {
            const int stage_block = gridDim.x > 1 ? blockIdx.x - 1 : 0;
#if EP_USE_FP8
            stage_tokens(x, at<uint8_t>(workspace, layout.send_x[parity]), at<float>(workspace, layout.send_scales[parity]),
                         layout.send_row_bytes, num_tokens, hidden, stage_block * num_stage_warps + warp,
                         num_stage_blocks * num_stage_warps);
#else
            stage_tokens(x, at<uint8_t>(workspace, layout.send_x[parity]), nullptr, layout.send_row_bytes, num_tokens,
                         hidden, (stage_block * num_stage_warps + warp) * kWarpSize + lane,
                         num_stage_blocks * num_stage_warps * kWarpSize);
#endif
            // Each staging warp publishes its own rows: no barrier among the staging warps, which
            // the planning warp, busy meanwhile, could not join.
            __syncwarp();
            if (lane == 0) red_add_release(&state->dispatch_staged[parity], 1u);
            EP_TRACE_POINT(1);
        }
    }

    if (phases & kPhaseRecv) {
        EP_TRACE_POINT(3);
        const uint64_t start_ns = global_timer_ns();
        const int num_local_experts = static_cast<int>(layout.num_local_experts);
        const int64_t num_rows_per_expert = static_cast<int64_t>(num_ranks) * layout.num_max_tokens;
        int* s_base = reinterpret_cast<int*>(s_bits);
        const int out_row_bytes = EP_USE_FP8 ? hidden : hidden * 2;
        // recv_scales[e_l][row][column], 4-byte words: at e_l * rows per expert * columns + row *
        // scale_row_stride + column * scale_column_stride; row-major (columns, 1) or DeepEP's
        // column-major view (1, rows per expert), as the caller's array is laid out.
        const int num_scale_columns = EP_USE_UE8M0 ? (num_scales + 3) / 4 : num_scales;
        const int num_warps_total = gridDim.x * kNumWarps;
        const int num_pairs = num_ranks * num_local_experts;

        if (warp == kPlanWarp) {
            const int num_rows = plan_receive(layout, workspace, route, parity, rank, (phases & kPhaseSend) != 0,
                                              step, active_ranks, timeout_ns, start_ns, recv_count, s_verdict,
                                              s_target, s_counts, s_start, s_flat, s_base, s_base + EP_MAX_EXPERTS);
            if (lane == 0) s_num_rows = num_rows;
        }
        __syncthreads();  // the plan; in a staging block, also this block's staging
        // Every live source's send half, a thread each, in one round: its lists and staged rows
        // are readable once its count reaches the target its routing flag announced.
        bool unstaged_here = false;  // a live source's staging timed out in this block
        if (threadIdx.x < num_ranks) {
            const int src = threadIdx.x;
            bool staged = false;
            if (s_verdict[src] == kSourceLive) {
                const State* src_state = reinterpret_cast<const State*>(route[src] + layout.state);
                staged = wait_count(src_state->dispatch_staged + parity, s_target[src], active_ranks, src,
                                    peer_timeout_ns(src, rank, (phases & kPhaseSend) != 0, timeout_ns), start_ns);
            }
            s_staged[src] = staged;
            unstaged_here = s_verdict[src] == kSourceLive && !staged;
            if (unstaged_here)  // its rows are zeros here: the last block keeps every combine off them
                atomicOr(reinterpret_cast<unsigned long long*>(state->dispatch_unstaged + parity), 1ull << src);
        }
        const bool block_unstaged = __syncthreads_or(unstaged_here);
        EP_TRACE_POINT(8);
        const int num_rows = s_num_rows;

        // recv_scales row `row` of local expert e_l (4-byte words).
        const auto scale_row = [&](int local_expert, int row) {
            return static_cast<uint32_t*>(recv_scales) + local_expert * num_rows_per_expert * num_scale_columns +
                   static_cast<int64_t>(row) * scale_row_stride;
        };
        // The staged fp32 scales of token `token` of source `src`.
        const auto source_scales = [&](int src, int token) {
            return reinterpret_cast<const float*>(route[src] + layout.send_scales[parity]) +
                   static_cast<int64_t>(token) * num_scales;
        };
        // One warp copies received row `row` of local expert e_l from its source's staging, or writes
        // it as zeros where the source is unstaged; with its scales unless num_row_scales is 0.
        const auto receive_row = [&](int src, int token, int local_expert, int row, int num_row_scales) {
            uint8_t* dst_row = recv_x + (local_expert * num_rows_per_expert + row) * out_row_bytes;
            void* dst_scale_row = EP_USE_FP8 ? static_cast<void*>(scale_row(local_expert, row)) : nullptr;
            if (!s_staged[src]) {
                zero_row(dst_row, dst_scale_row, out_row_bytes, num_row_scales > 0 ? num_scale_columns : 0);
                return;
            }
            const uint8_t* src_row =
                reinterpret_cast<const uint8_t*>(route[src] + layout.send_x[parity]) + token * layout.send_row_bytes;
            copy_row(src_row, source_scales(src, token), dst_row, dst_scale_row, out_row_bytes, num_row_scales);
        };

        // Received row n (in pair order) is row j of pair (source, local expert): its source, the
        // token's index in that source's staging (read only where the source staged), its local
        // expert and its row within that expert.
        const auto find_row = [&](int n, int& src, int& token, int& local_expert, int& row) {
            const int pair = upper_bound(s_flat, num_pairs, n) - 1;
            const int j = n - s_flat[pair];
            src = pair / num_local_experts;
            local_expert = pair % num_local_experts;
            row = s_base[pair] + j;
            if (s_staged[src]) {
                const int* send_list = reinterpret_cast<const int*>(route[src] + layout.send_list[parity]);
                token = ld_cg_int(send_list + s_start[pair] + j);
            }
        };

        // Rows are numbered n over the whole grid in pair order: warp g copies the rows whose number
        // is g modulo the grid's warps W. At iteration i a block's warps copy kGroupRows neighbouring
        // rows (i W + blockIdx.x kGroupRows + warp), which neighbouring rows' scales use below.
        constexpr int kGroupRows = kNumWarps;
        if (!EP_USE_FP8 || scale_column_stride == 1) {
            // bf16, or scale column stride 1 (row-major, or DeepEP's layout with one row an expert): a
            // row's scale words are contiguous, its warp stores them. Lane j looks up the warp's row
            // base + j W.
            const int global_warp = blockIdx.x * kNumWarps + warp;
            for (int base = global_warp; base < num_rows; base += kWarpSize * num_warps_total) {
                const int my_n = base + lane * num_warps_total;
                int my_src = 0, my_token = 0, my_expert = 0, my_row = 0;
                if (my_n < num_rows) find_row(my_n, my_src, my_token, my_expert, my_row);
                const int rows_here = min(kWarpSize, (num_rows - base + num_warps_total - 1) / num_warps_total);
                if (base == global_warp) EP_TRACE_POINT(15);  // thread 0: warp 0's first row, found
                for (int i = 0; i < rows_here; ++i)
                    receive_row(__shfl_sync(kFullMask, my_src, i), __shfl_sync(kFullMask, my_token, i),
                                __shfl_sync(kFullMask, my_expert, i), __shfl_sync(kFullMask, my_row, i), num_scales);
            }
        } else {
            // DeepEP's column-major scales (or one scale column, stride 0): a sector holds one column
            // of 8 neighbouring rows. Stored by each row's warp, every 4-byte word was a write request
            // of its own, more requests than the rows' (H100 decode dispatch +4.8 us over row-major).
            // Here the block's warps store a group's scales together, a column of its 16 rows per
            // half-warp store: the block looks up a window of groups, a row a thread, into shared
            // memory, then the group's scale slices (4 columns, or one UE8M0 word) are dealt over
            // its warps before each warp copies its row (docs/performance.md (53)).
            constexpr int kWindowIters = EP_NUM_THREADS / kGroupRows;
            __shared__ int s_window_src[EP_NUM_THREADS], s_window_token[EP_NUM_THREADS];
            __shared__ int s_window_expert[EP_NUM_THREADS], s_window_row[EP_NUM_THREADS];  // expert -1: no row
            const int first_row_of_block = blockIdx.x * kGroupRows;
            const int num_iters = num_rows > first_row_of_block
                                      ? (num_rows - first_row_of_block + num_warps_total - 1) / num_warps_total
                                      : 0;  // the same in every warp of the block: the barriers below
            const int num_slices = EP_USE_UE8M0 ? num_scale_columns : (num_scales + 3) / 4;
            const int num_scale_items = num_slices * kGroupRows;
            const int num_scale_stores = (num_scale_items + kWarpSize - 1) / kWarpSize;
            for (int window = 0; window < num_iters; window += kWindowIters) {
                __syncthreads();  // every warp is done with the previous window's slots
                const int slot = threadIdx.x, slot_iter = window + slot / kGroupRows;
                const int n = slot_iter * num_warps_total + first_row_of_block + slot % kGroupRows;
                int src = 0, token = 0, local_expert = -1, row = 0;
                if (slot_iter < num_iters && n < num_rows) find_row(n, src, token, local_expert, row);
                s_window_src[slot] = src;
                s_window_token[slot] = token;
                s_window_expert[slot] = local_expert;
                s_window_row[slot] = row;
                __syncthreads();
                if (window == 0) EP_TRACE_POINT(15);  // thread 0: the block's first rows, found
                for (int iter = window; iter < min(window + kWindowIters, num_iters); ++iter) {
                    const int group = (iter - window) * kGroupRows;
                    // Rotated by the iteration: the stores are often fewer than the warps.
                    for (int store = (warp + iter * num_scale_stores) % kNumWarps; store < num_scale_stores;
                         store += kNumWarps) {
                        const int item = store * kWarpSize + lane;
                        const int r = group + item % kGroupRows;
                        if (item >= num_scale_items || s_window_expert[r] < 0) continue;
                        const int item_src = s_window_src[r];
                        // An unstaged source's: none, scale 0.
                        const float* src_scales =
                            s_staged[item_src] ? source_scales(item_src, s_window_token[r]) : nullptr;
                        copy_scale_slice(src_scales, scale_row(s_window_expert[r], s_window_row[r]), item / kGroupRows,
                                         num_scales, scale_column_stride);
                    }
                    const int own = group + warp;
                    if (s_window_expert[own] >= 0)
                        receive_row(s_window_src[own], s_window_token[own], s_window_expert[own], s_window_row[own], 0);
                }
            }
        }
        EP_TRACE_POINT(6);
        if (finish_block(&state->dispatch_recv_done[parity], &s_is_last, block_unstaged, &s_any_unstaged)) {
            if (s_any_unstaged) {
                // Every block's bits and block 0's recv_range are ordered before this (finish_block).
                const uint64_t unstaged = ld_acquire_sys(state->dispatch_unstaged + parity);
                int2* recv_range = at<int2>(workspace, layout.recv_range[parity]);
                for (int i = threadIdx.x; i < num_pairs; i += blockDim.x)  // i = local expert * R + source
                    if ((unstaged >> (i % num_ranks)) & 1ull) recv_range[i].y = 0;
                __syncthreads();  // every thread has read the bits
                if (threadIdx.x == 0) state->dispatch_unstaged[parity] = 0ull;
            }
            if (threadIdx.x == 0) {
                state->dispatch_step[parity] = step;
                EP_TRACE_POINT(7);
            }
        }
    }
}
