// signal.cuh: epoch-tagged flags and the timed wait.
//
// A flag is one u64: the high 32 bits are the step (epoch) it belongs to, the low 32 bits a payload
// (a count to wait for, or 1). A receiver takes a flag only when its step equals the step it
// expects, so a stale flag from an earlier step, from a slow peer or one that was masked and came
// back, is never mistaken for current data, and no pass is needed to clean flags between steps.
//
// wait_flag spins with ld.acquire.sys until the flag carries `step`, the peer is marked inactive by
// someone else, or `timeout_ns` (>= 0) elapses on %globaltimer. On expiry it writes
// active_ranks[peer] = 0, which the caller sees in its tensor afterwards. It never traps.
//
// decide_source gives every block of a receiving grid the same answer for one source: the first
// block to see the flag (or to time out) writes the call's verdict, and every later reader takes it,
// so no two blocks of one call disagree on whether a source is live (which would leave rows or
// counts written for a source that other blocks skipped).
//
// wait_count waits for a peer's counter to reach a target it published (a cumulative count that
// never resets, so it needs no epoch: the target of each step is past every earlier step's), with
// the same mask and timeout rules as wait_flag.
//
// A rank's waits on itself (peer_timeout_ns). In a launch that holds its send half, its own flags
// and counts come from its own blocks, which are resident with the waiting one (the Buffer's num_sms
// budget), so they arrive within microseconds: it waits at least kSelfTimeoutFloorNs, whatever
// timeout_ns says. A shorter bound (timeout_us = 0 gives up on anything not already there) had masked
// the rank in its own eyes, its own rows dropped. It still gives up on itself, later: waiting forever
// where the caller asked for a bound would hang a call whose own send half stopped short of a count
// it announced (the fault tests stage one by hand). In a receive half launched alone (a hook), the
// send half ended before the launch, so they are there already or never come (the rank was masked
// in its own active_ranks then): no wait at all.
//
// signal_ranks and wait_ranks are the two ends used by every protocol: one thread per peer, so R
// flags cost one store (or one wait) of latency, not R. A flag lives at the same offset of every
// workspace: flags[parity * EP_MAX_RANKS + writer_rank] of the receiving rank.
#pragma once

#include "ptx.cuh"

namespace ep {

// The step after `step`, skipping 0: a zeroed word (a fresh workspace, the flags cleared for a
// replaced rank, a verdict slot never written) decodes as step 0, so no call may ever expect 0,
// even after 2^32 calls on one parity wrap the counter.
__device__ __forceinline__ uint32_t next_step(uint32_t step) { return step == 0xFFFFFFFFu ? 1u : step + 1u; }

__device__ __forceinline__ uint64_t pack_flag(uint32_t step, uint32_t payload) {
    return (static_cast<uint64_t>(step) << 32) | payload;
}
__device__ __forceinline__ uint32_t flag_step(uint64_t flag) { return static_cast<uint32_t>(flag >> 32); }
__device__ __forceinline__ uint32_t flag_payload(uint64_t flag) { return static_cast<uint32_t>(flag); }

// The end of one pass of a wait on `peer` that has not seen what it waits for: true when the wait
// should give up, because the peer is masked (before this call, or by another wait that gave up on
// it) or `timeout_ns` (>= 0) has passed since `start_ns`; then this wait masks it itself.
__device__ __forceinline__ bool give_up_on(int* active_ranks, int peer, int64_t timeout_ns, uint64_t start_ns) {
    if (ld_volatile(active_ranks + peer) == 0) return true;
    if (timeout_ns >= 0 && static_cast<int64_t>(global_timer_ns() - start_ns) > timeout_ns) {
        atomicExch(active_ranks + peer, 0);
        return true;
    }
    return false;
}

// The timeout of a wait by `rank` on `peer` in a launch that holds this rank's send half or not (see
// the top of this file). A negative timeout_ns (forever) stays forever on a peer, and on itself in a
// launch of both halves; a receive half launched alone never waits on itself, whatever timeout_ns.
// That rests on the stream order: the hook's launch comes after its send half's on the same stream.
constexpr int64_t kSelfTimeoutFloorNs = 100 * 1000 * 1000;  // 100 ms: ~10^4 x a rank's own flag delay
__device__ __forceinline__ int64_t peer_timeout_ns(int peer, int rank, bool sends_in_launch, int64_t timeout_ns) {
    if (peer != rank) return timeout_ns;
    if (!sends_in_launch) return 0;
    return timeout_ns >= 0 && timeout_ns < kSelfTimeoutFloorNs ? kSelfTimeoutFloorNs : timeout_ns;
}

// Returns true with *payload set when the flag arrived; false when the peer is (now) masked.
__device__ __forceinline__ bool wait_flag(const uint64_t* flag, uint32_t step, int* active_ranks, int peer,
                                          int64_t timeout_ns, uint32_t* payload) {
    const uint64_t start_ns = global_timer_ns();
    while (true) {
        const uint64_t value = ld_acquire_sys(flag);
        if (flag_step(value) == step) {
            *payload = flag_payload(value);
            return true;
        }
        if (give_up_on(active_ranks, peer, timeout_ns, start_ns)) return false;
    }
}

// Returns true once *counter - target >= 0 (modulo 2^32: the counter may wrap), acquired; false when
// the peer is (now) masked or `timeout_ns` (>= 0) passed since `start_ns` (give_up_on).
__device__ __forceinline__ bool wait_count(const uint32_t* counter, uint32_t target, int* active_ranks, int peer,
                                           int64_t timeout_ns, uint64_t start_ns) {
    while (true) {
        if (static_cast<int32_t>(ld_acquire_u32(counter) - target) >= 0) return true;
        if (give_up_on(active_ranks, peer, timeout_ns, start_ns)) return false;
    }
}

constexpr int kSourceDead = 0;
constexpr int kSourceLive = 1;

// The verdict of this call (`step`) on source `src`, waited for: kSourceLive once its flag carries
// `step`, kSourceDead when it was masked before (active_ranks) or `timeout_ns` (>= 0) passed since
// `start_ns` without it. The first caller to reach a conclusion stores it in `verdict` (u64
// pack(step, live), compare-and-swap: one winner) and every caller returns the stored one. A dead
// verdict writes active_ranks[src] = 0. A live verdict is published after a fence, so a reader that
// takes it (acquire) is ordered after the source's release store as if it had read the flag itself.
__device__ __forceinline__ int decide_source(uint64_t* verdict, const uint64_t* flag, uint32_t step, int* active_ranks,
                                             int src, int64_t timeout_ns, uint64_t start_ns) {
    while (true) {
        const uint64_t seen = ld_acquire_sys(verdict);
        if (flag_step(seen) == step) return static_cast<int>(flag_payload(seen));
        // The mask first: a source this rank masked (before this call, or through a verdict of this
        // call) is dead even if its flag carries the step (it may not know it is masked).
        int conclusion;
        if (ld_volatile(active_ranks + src) == 0) {
            conclusion = kSourceDead;
        } else if (flag_step(ld_acquire_sys(flag)) == step) {
            conclusion = kSourceLive;
        } else if (timeout_ns >= 0 && static_cast<int64_t>(global_timer_ns() - start_ns) > timeout_ns) {
            conclusion = kSourceDead;
        } else {
            continue;
        }
        fence_acq_rel_sys();
        const unsigned long long proposal = pack_flag(step, static_cast<uint32_t>(conclusion));
        if (atomicCAS(reinterpret_cast<unsigned long long*>(verdict), seen, proposal) == seen) {
            if (conclusion == kSourceDead) atomicExch(active_ranks + src, 0);
            return conclusion;
        }
        // Another block concluded first: take its verdict on the next pass.
    }
}

// Threads d < num_ranks of the calling block store, with release semantics, flag[slot] = value in
// rank d's workspace, skipping ranks active_ranks marks 0 (no bytes to a masked rank). Call from a
// block whose threads have seen (finish_block) everything the flag publishes.
__device__ __forceinline__ void signal_ranks(const uint64_t* route, int64_t flags_offset, int slot, int num_ranks,
                                             const int* active_ranks, uint64_t value) {
    const int dst = threadIdx.x;
    if (dst < num_ranks && ld_volatile(active_ranks + dst) != 0)
        st_release_sys(reinterpret_cast<uint64_t*>(route[dst] + flags_offset) + slot, value);
}

// Threads r < num_ranks wait for flags[r] (this rank's own flags of one parity) to carry `step`;
// s_live[r] = it arrived (0 for a rank masked before or by this wait). Every thread of the block
// calls it; it ends with a barrier, so s_live is then visible to the whole block.
__device__ __forceinline__ void wait_ranks(const uint64_t* flags, uint32_t step, int* active_ranks, int num_ranks,
                                           int rank, bool sends_in_launch, int64_t timeout_ns, int* s_live) {
    const int src = threadIdx.x;
    if (src < num_ranks) {
        bool live = false;
        if (ld_volatile(active_ranks + src) != 0) {
            uint32_t payload;
            live = wait_flag(flags + src, step, active_ranks, src, peer_timeout_ns(src, rank, sends_in_launch, timeout_ns),
                             &payload);
        }
        s_live[src] = live;
    }
    __syncthreads();
}

// wait_ranks with one verdict per rank for the whole grid (decide_source): every block of the call
// takes the same s_live, even for a flag that lands just as some block's timeout passes.
__device__ __forceinline__ void decide_ranks(uint64_t* verdicts, const uint64_t* flags, uint32_t step,
                                             int* active_ranks, int num_ranks, int rank, bool sends_in_launch,
                                             int64_t timeout_ns, int* s_live) {
    const int src = threadIdx.x;
    if (src < num_ranks)
        s_live[src] = decide_source(verdicts + src, flags + src, step, active_ranks, src,
                                    peer_timeout_ns(src, rank, sends_in_launch, timeout_ns), global_timer_ns()) ==
                      kSourceLive;
    __syncthreads();
}

}  // namespace ep
