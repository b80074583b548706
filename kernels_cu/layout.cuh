// layout.cuh: the symmetric workspace every rank allocates, and where each region lies in it.
//
// Every rank's workspace has the same layout, so a rank finds a region of peer r's workspace at
// peer_base[r] + the same offset. The offsets are computed once per configuration on the host
// (mooncake_ep/layout.py, the only place that does the arithmetic) and stored in device memory as
// this struct; a CPU test compiles this header with the host compiler and checks that the Python
// packing matches offsetof() of every field.
//
// Regions (P = 2 parities, so two calls can be in flight, e.g. two micro-batches in hook mode;
// R ranks, E experts, E_l = E / R, T = num_max_dispatch_tokens_per_rank, H hidden, K_max = 16):
//   state                  State, written only by this rank (epochs, block finish counters, and the
//                          staging counter peers read in dispatch)
//   dispatch_flag[P][R]    u64, written by peer r: "my routing for this step is out" (its per-expert
//                          prefix; the payload is the staging count to wait for, ll_dispatch.cu)
//   dispatch_verdict[P][R] u64, written by this rank's receiving blocks: the call's one decision
//                          on whether source r delivered or was masked (signal.cuh, decide_source)
//   combine_flag[P][R]     u64, written by peer r: "my expert outputs for this step are ready"
//   combine_verdict[P][R]  u64, written by this rank's combining blocks: the call's one decision on
//                          whether expert rank r answered or was masked (as dispatch_verdict)
//   combine_ack[P][R]      u64, written by peer r: "I have read your expert outputs of this step"
//                          (only when they were read from the caller's own array, see combine_source)
//   combine_source[P]      u64, written by this rank before its combine flags: where peers read its
//                          expert outputs; 0 = this workspace's combine_x, else an address every rank
//                          of this process can read (the local transport's direct read)
//   route[R]               u64, the route table: base address of each peer's workspace (as this
//                          rank can dereference it: same process, peer device or IPC mapping)
//   send_x[P]              [T][2H] bytes: this rank's tokens, staged (fp8 uses the first H bytes)
//   send_scales[P]         [T][H/128] fp32: their fp8 scales
//   send_expert_offset[P]  [E+1] i32: exclusive prefix of this rank's copies per expert
//   send_list[P]           [T*K_max] i32: the token of each copy, grouped by expert in (token, k) order
//   send_slot[P]           [T*K_max] i32: the position of copy (token, k) inside its expert's group
//   recv_range[P]          [E_l][R] int2: (first row, rows) of source rank r in local expert e_l;
//                          rows 0 for a source whose staging timed out (its zero rows, which
//                          recv_count still counts, are not read back by combine)
//   combine_x[P]           [E_l][R*T][H] bf16: expert outputs, read by the token owners in combine
// The first eight are laid out independently of the configuration, so epochs survive a change of
// shape; the rest depend on (T, H, E, R) and lie parity-major: parity p's in the p-th half of the
// workspace past the header, whatever the configuration, so the call before, which peers may still
// be reading, never shares a byte with this one, even when its (T, H, E) differed.
#pragma once

#include "types.cuh"

namespace ep {

constexpr int kNumParities = 2;

struct State {
    uint32_t dispatch_step[kNumParities];  // epoch of the last completed dispatch per parity
    uint32_t combine_step[kNumParities];
    // dispatch: parts of this rank's send half published (block 0's lists, each staging warp's
    // rows), summed over every call; peers wait for it to reach dispatch_staged_target.
    uint32_t dispatch_staged[kNumParities];
    uint32_t dispatch_recv_done[kNumParities];  // blocks that finished the phase in the current call
    uint32_t combine_send_done[kNumParities];
    uint32_t combine_recv_done[kNumParities];
    uint32_t dispatch_staged_target[kNumParities];  // dispatch_staged once the current call's send half is out
    // dispatch: the sources that some receiving block of the current call found routed but never
    // staged (their rows written as zeros), bit r for rank r. The last block to finish takes them
    // out of recv_range and clears the word.
    uint64_t dispatch_unstaged[kNumParities];
};

struct Layout {
    int64_t num_ranks;
    int64_t num_experts;
    int64_t num_local_experts;
    int64_t num_max_tokens;  // T = num_max_dispatch_tokens_per_rank
    int64_t hidden;
    int64_t num_scales;       // H / 128
    int64_t send_row_bytes;   // bytes of one staged token row
    int64_t state;
    int64_t dispatch_flag;
    int64_t dispatch_verdict;
    int64_t combine_flag;
    int64_t combine_verdict;
    int64_t combine_ack;
    int64_t combine_source;
    int64_t route;
    int64_t send_x[kNumParities];
    int64_t send_scales[kNumParities];
    int64_t send_expert_offset[kNumParities];
    int64_t send_list[kNumParities];
    int64_t send_slot[kNumParities];
    int64_t recv_range[kNumParities];
    int64_t combine_x[kNumParities];
    int64_t num_bytes;
};

}  // namespace ep
