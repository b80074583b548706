"""Probe: how fast can an H200 write device memory, and do the dispatch's row copies reach it?

docs/performance.md (23) found that the decode dispatch's copies run at the rate of a fill
(`torch.fill_`, ~3.4 TB/s write only, against 4.3 TB/s read + written for a copy), and (16), (24)
that starting them sooner does not end them sooner. Before another protocol change the question is
whether any store path writes faster than that fill: a fill with 16-byte stores, plain or streaming
(evict-first), `cudaMemsetAsync`, and Hopper's bulk copy engine (`cp.async.bulk` from shared
memory), on 128 SMs (the decode's 8 ranks x 16) or every SM, on the dispatch's 60 MB rewritten
again and again or on 1 GiB. Then the dispatch's copy itself, alone: 8192 rows of 7168 bytes from
7.3 MB of L2-resident staged rows into a 60 MB `recv_x`, by warps (`ld.cg` + `st.cs`, the
library's `warp_copy`) or by the bulk copy engine (a row into shared memory, then out). And two
questions about that copy (docs/performance.md (27)): would reading each staged row once for all of
its copies to one receiving rank (~1.5 at this shape) be faster, and does the order in which the
rows are dealt out matter, in the kernel's own layout (each receiver's recv_x, R*T rows an expert)?

A development probe, not part of the library.

    python scripts/write_rate_probe.py --json write_rate.json
"""
from __future__ import annotations

import argparse
import functools
import json

SOURCE = r"""
typedef unsigned long long uint64_t;
typedef unsigned int uint32_t;

// Every thread stores 16-byte vectors, grid-stride; streaming = .cs (evict-first in L2).
extern "C" __global__ void fill_v4(int4* dst, long long num_vectors, int streaming) {
    const int4 value = make_int4(0x5A5A5A5A, 0x5A5A5A5A, 0x5A5A5A5A, 0x5A5A5A5A);
    long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    if (streaming) {
        for (; i < num_vectors; i += stride) __stcs(dst + i, value);
    } else {
        for (; i < num_vectors; i += stride) dst[i] = value;
    }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Lane 0 of every warp stores rows of row_bytes from its own slot of shared memory with the bulk
// copy engine, up to max_in_flight bulk groups outstanding.
extern "C" __global__ void fill_bulk(char* dst, long long num_rows, int row_bytes, int max_in_flight) {
    extern __shared__ __align__(128) char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    char* slot = smem + static_cast<long long>(warp) * row_bytes;
    for (int i = lane * 16; i < row_bytes; i += 32 * 16)
        *reinterpret_cast<int4*>(slot + i) = make_int4(0x5A5A5A5A, 0x5A5A5A5A, 0x5A5A5A5A, 0x5A5A5A5A);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane != 0) return;
    const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32);
    int outstanding = 0;
    for (long long row = blockIdx.x * (blockDim.x / 32) + warp; row < num_rows; row += warps) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + row * row_bytes), "r"(smem_addr(slot)), "r"(row_bytes) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (++outstanding >= max_in_flight) {
            asm volatile("cp.async.bulk.wait_group.read 4;" ::: "memory");
            outstanding = 4;
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// One warp copies a row of row_vectors 16-byte vectors, 8 loads in flight a lane (the library's
// warp_copy: ld.cg, st.cs).
__device__ __forceinline__ void warp_copy_row(const int4* from, int4* to, int row_vectors) {
    const int lane = threadIdx.x % 32;
    for (int base = 0; base < row_vectors; base += 8 * 32) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * 32 + lane;
            if (i < row_vectors) v[u] = __ldcg(from + i);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = base + u * 32 + lane;
            if (i < row_vectors) __stcs(to + i, v[u]);
        }
    }
}

// The dispatch's copy: dst row r <- src row source[r], one warp a row, rows r = warp mod warps.
extern "C" __global__ void copy_rows_warp(const int4* src, const int* source, int4* dst, int num_rows,
                                          int row_vectors) {
    const int warps = gridDim.x * (blockDim.x / 32);
    for (int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < num_rows; row += warps) {
        const int4* from = src + static_cast<long long>(source[row]) * row_vectors;
        int4* to = dst + static_cast<long long>(row) * row_vectors;
        warp_copy_row(from, to, row_vectors);
    }
}

// The dispatch's copy with each source row read once for all its copies to one receiver: group g
// reads src row group_source[g] and writes it to dst rows dst_rows[group_first[g] ..
// group_first[g + 1]) (at most 32), one warp a group, groups g = warp mod warps.
// warp_first_group: null, or a contiguous range of groups per warp, [warp_first_group[w],
// warp_first_group[w + 1]), cut so that every warp writes about as many rows.
extern "C" __global__ void copy_groups_warp(const int4* src, const int* group_source, const int* group_first,
                                            const int* dst_rows, int4* dst, int num_groups, int row_vectors,
                                            const int* warp_first_group) {
    const int lane = threadIdx.x % 32;
    const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int warps = warp_first_group ? 1 : gridDim.x * (blockDim.x / 32);
    const int first_group = warp_first_group ? warp_first_group[warp] : warp;
    const int end_group = warp_first_group ? warp_first_group[warp + 1] : num_groups;
    for (int g = first_group; g < end_group; g += warps) {
        const int4* from = src + static_cast<long long>(group_source[g]) * row_vectors;
        const int first = group_first[g], num_dst = group_first[g + 1] - first;
        const int my_dst = lane < num_dst ? dst_rows[first + lane] : 0;
        for (int base = 0; base < row_vectors; base += 8 * 32) {
            int4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const int i = base + u * 32 + lane;
                if (i < row_vectors) v[u] = __ldcg(from + i);
            }
            for (int d = 0; d < num_dst; ++d) {
                int4* to = dst + static_cast<long long>(__shfl_sync(0xFFFFFFFFu, my_dst, d)) * row_vectors;
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int i = base + u * 32 + lane;
                    if (i < row_vectors) __stcs(to + i, v[u]);
                }
            }
        }
    }
}

// The dispatch's copy as the kernel lays it out: each receiver's copies in its own recv_x (rows of
// E_l experts, R*T apart), copied by its own blocks_per_receiver blocks in the order of its list
// (copy_source[n] -> copy_dst[n] for n in [receiver_first[r], receiver_first[r + 1])), rows n
// dealt to the receiver's warps modulo their number.
extern "C" __global__ void copy_rows_per_receiver(const int4* src, const int* copy_source, const long long* copy_dst,
                                                  const int* receiver_first, int4* dst, int blocks_per_receiver,
                                                  int row_vectors) {
    const int receiver = blockIdx.x / blocks_per_receiver;
    const int warps = blocks_per_receiver * (blockDim.x / 32);
    const int end = receiver_first[receiver + 1];
    for (int n = receiver_first[receiver] + (blockIdx.x % blocks_per_receiver) * (blockDim.x / 32) + threadIdx.x / 32;
         n < end; n += warps) {
        const int4* from = src + static_cast<long long>(copy_source[n]) * row_vectors;
        int4* to = dst + copy_dst[n] * row_vectors;
        warp_copy_row(from, to, row_vectors);
    }
}

// The same copy through the bulk copy engine: lane 0 of each warp loads a row into the warp's
// slots (slots_per_warp of them, round robin) and stores it out, without registers in between.
extern "C" __global__ void copy_rows_bulk(const char* src, const int* source, char* dst, int num_rows,
                                          int row_bytes, int slots_per_warp, int evict_first) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) uint64_t barriers[32 * 4];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane != 0) return;
    uint64_t* bar = barriers + warp * 4;
    for (int s = 0; s < slots_per_warp; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int warps = gridDim.x * (blockDim.x / 32);
    char* slots = smem + static_cast<long long>(warp) * slots_per_warp * row_bytes;
    uint32_t phases = 0;  // bit s: the parity slot s waits for next
    int n = 0;
    for (int row = blockIdx.x * (blockDim.x / 32) + warp; row < num_rows; row += warps, ++n) {
        const int s = n % slots_per_warp;
        char* slot = slots + static_cast<long long>(s) * row_bytes;
        // The slot's last store must have read it before the next load overwrites it.
        if (n >= slots_per_warp) {
            if (slots_per_warp == 1) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            else if (slots_per_warp == 2) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            else asm volatile("cp.async.bulk.wait_group.read 2;" ::: "memory");
        }
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(smem_addr(bar + s)), "r"(row_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_addr(slot)), "l"(src + static_cast<long long>(source[row]) * row_bytes),
                        "r"(row_bytes), "r"(smem_addr(bar + s)) : "memory");
        uint32_t done = 0;
        const uint32_t parity = (phases >> s) & 1u;
        while (!done) {
            asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                         " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_addr(bar + s)), "r"(parity) : "memory");
        }
        phases ^= 1u << s;
        if (evict_first) {
            uint64_t policy;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
                         :: "l"(dst + static_cast<long long>(row) * row_bytes), "r"(smem_addr(slot)), "r"(row_bytes),
                            "l"(policy) : "memory");
        } else {
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(dst + static_cast<long long>(row) * row_bytes), "r"(smem_addr(slot)), "r"(row_bytes)
                         : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="timed launches per case")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import cupy
    import numpy

    module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
    kernels = {name: module.get_function(name) for name in
               ("fill_v4", "fill_bulk", "copy_rows_warp", "copy_rows_bulk", "copy_groups_warp",
                               "copy_rows_per_receiver")}
    device = cupy.cuda.Device()
    num_sms = device.attributes["MultiProcessorCount"]
    for kernel in kernels.values():  # the most any case below asks for: 24 slots of 7168 bytes
        kernel.max_dynamic_shared_size_bytes = 24 * 7168
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def time_us(launch) -> float:
        for _ in range(20):
            launch()
        start.record()
        for _ in range(args.iters):
            launch()
        end.record()
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.iters

    row_bytes, num_rows = 7168, 8192  # the decode dispatch's recv_x: fp8 rows of H = 7168
    dispatch_bytes = row_bytes * num_rows
    results = []

    def report(case: str, blocks: int, written: int, micros: float) -> None:
        rate = written / micros / 1e6
        results.append({"case": case, "blocks": blocks, "bytes_written": written, "us": micros, "tbps": rate})
        print(f"{case:58s} blocks {blocks:4d}  {written / 1e6:8.1f} MB  {micros:8.2f} us  {rate:5.2f} TB/s", flush=True)

    for size_name, num_bytes in (("60 MB (the dispatch's recv_x)", dispatch_bytes), ("1 GiB", 1 << 30)):
        dst = cupy.empty(num_bytes, dtype=cupy.uint8)
        num_vectors = num_bytes // 16
        report(f"cudaMemsetAsync, {size_name}", 0, num_bytes,
               time_us(lambda: cupy.cuda.runtime.memsetAsync(dst.data.ptr, 0x5A, num_bytes,
                                                             cupy.cuda.get_current_stream().ptr)))
        for blocks, threads in ((128, 512), (num_sms, 512), (4 * num_sms, 256)):
            for streaming in (0, 1):
                report(f"fill, 16-byte {'.cs' if streaming else 'plain'} stores, {size_name}", blocks, num_bytes,
                       time_us(lambda: kernels["fill_v4"]((blocks,), (threads,),
                                                          (dst, cupy.int64(num_vectors), cupy.int32(streaming)))))
        for blocks in (128, num_sms):
            warps = 16
            report(f"fill, bulk stores of 7168 B, 16 warps, {size_name}", blocks, num_bytes,
                   time_us(lambda: kernels["fill_bulk"]((blocks,), (warps * 32,),
                                                        (dst, cupy.int64(num_bytes // row_bytes),
                                                         cupy.int32(row_bytes), cupy.int32(8)),
                                                        shared_mem=warps * row_bytes)))
        try:
            import torch
        except ImportError:
            pass
        else:  # on torch's default stream, the legacy one, as cupy's events here
            tensor = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
            report(f"torch fill_ (the benchmark's write rate until (25)), {size_name}", 0, num_bytes,
                   time_us(functools.partial(tensor.fill_, 0x5A)))
            del tensor
        del dst

    # The copy: 8 sources x 128 tokens of staged rows, each read by its 8 copies (top-8 of 256
    # experts, uniform, 32 experts a receiving rank), dst rows in (receiver, expert, source, token)
    # order as the kernel's recv_x. Grouped: each (receiver, source, token) reads its row once.
    rng = numpy.random.default_rng(0)
    num_ranks, num_tokens, num_experts, num_topk = 8, 128, 256, 8
    src = cupy.asarray(rng.integers(0, 256, size=num_ranks * num_tokens * row_bytes, dtype=numpy.uint8))
    experts = numpy.stack([rng.permutation(num_experts)[:num_topk] for _ in range(num_ranks * num_tokens)])
    copies = sorted((int(e), row, int(e) // (num_experts // num_ranks))  # (expert, staged row, receiver)
                    for row in range(num_ranks * num_tokens) for e in experts[row])
    source_host = numpy.array([row for _, row, _ in copies], dtype=numpy.int32)
    groups: dict[tuple[int, int], list[int]] = {}
    for dst_row, (_, row, receiver) in enumerate(copies):
        groups.setdefault((receiver, row), []).append(dst_row)
    group_keys = sorted(groups)
    group_source = cupy.asarray(numpy.array([row for _, row in group_keys], dtype=numpy.int32))
    group_first = cupy.asarray(numpy.cumsum([0] + [len(groups[key]) for key in group_keys], dtype=numpy.int32))
    dst_rows = cupy.asarray(numpy.array([d for key in group_keys for d in groups[key]], dtype=numpy.int32))
    print(f"{len(group_keys)} groups for {num_rows} copies: {num_rows / len(group_keys):.2f} copies a read", flush=True)
    source = cupy.asarray(source_host)
    dst = cupy.empty(dispatch_bytes, dtype=cupy.uint8)
    for blocks in (128, num_sms):
        report("copy rows by warps (ld.cg + st.cs), 16 warps", blocks, dispatch_bytes,
               time_us(lambda: kernels["copy_rows_warp"]((blocks,), (512,),
                                                         (src, source, dst, cupy.int32(num_rows),
                                                          cupy.int32(row_bytes // 16)))))
        expected = src.reshape(-1, row_bytes)[source]
        assert bool((dst.reshape(-1, row_bytes) == expected).all()), "copy_rows_warp is wrong"
        # Contiguous ranges of groups, cut at the group boundary nearest each warp's share of rows
        # (the warps then write 2-7 rows, most 3-5, where round robin deals them 2-11).
        num_warps = blocks * 16
        rows_before = numpy.cumsum([0] + [len(groups[key]) for key in group_keys])
        shares = numpy.arange(num_warps + 1) * num_rows / num_warps
        after = numpy.minimum(numpy.searchsorted(rows_before, shares), len(group_keys))
        before = numpy.maximum(after - 1, 0)
        cuts = numpy.where(rows_before[after] - shares <= shares - rows_before[before], after, before)
        cuts[0], cuts[-1] = 0, len(group_keys)
        warp_first_group = cupy.asarray(cuts.astype(numpy.int32))
        for name, ranges in (("groups dealt round robin", numpy.uint64(0)), ("contiguous groups, rows balanced", warp_first_group)):
            dst.fill(0)
            report(f"copy rows grouped (a read per receiver and token), {name}", blocks, dispatch_bytes,
                   time_us(lambda: kernels["copy_groups_warp"]((blocks,), (512,),
                                                               (src, group_source, group_first, dst_rows, dst,
                                                                cupy.int32(len(group_keys)),
                                                                cupy.int32(row_bytes // 16), ranges))))
            assert bool((dst.reshape(-1, row_bytes) == expected).all()), "copy_groups_warp is wrong"
        for warps, slots, evict_first in ((16, 1, 0), (16, 1, 1), (8, 2, 1), (8, 3, 1)):
            dst.fill(0)
            report(f"copy rows by bulk copies, {warps} warps x {slots} slots{', evict-first' * evict_first}",
                   blocks, dispatch_bytes,
                   time_us(lambda: kernels["copy_rows_bulk"]((blocks,), (warps * 32,),
                                                             (src, source, dst, cupy.int32(num_rows),
                                                              cupy.int32(row_bytes), cupy.int32(slots),
                                                              cupy.int32(evict_first)),
                                                             shared_mem=warps * slots * row_bytes)))
            assert bool((dst.reshape(-1, row_bytes) == expected).all()), "copy_rows_bulk is wrong"

    # The kernel's own layout: receiver r's recv_x is [E_l][R*T] rows; the copies of source s to
    # expert e start after those of the sources before s. Rows numbered in (source, expert) pair
    # order, as ll_dispatch numbers them, or expert-major, where a receiver's rows of one expert are
    # one run.
    del dst
    experts_per_rank = num_experts // num_ranks
    rows_per_expert = num_ranks * num_tokens
    counts = numpy.zeros((num_experts, num_ranks), dtype=numpy.int64)  # [expert][source]
    per_copy = []  # (receiver, source, local expert, token, slot, staged row)
    for row in range(num_ranks * num_tokens):
        source_rank, token = divmod(row, num_tokens)
        for e in experts[row]:
            per_copy.append((int(e) // experts_per_rank, source_rank, int(e) % experts_per_rank, token,
                             int(counts[e, source_rank]), row))
            counts[e, source_rank] += 1
    first_of_source = numpy.cumsum(counts, axis=1) - counts
    dst = cupy.empty(num_ranks * experts_per_rank * rows_per_expert * row_bytes, dtype=cupy.uint8)
    for order_name, key in (("(source, expert) pairs, as the kernel", lambda c: (c[0], c[1], c[2], c[3])),
                            ("expert-major", lambda c: (c[0], c[2], c[1], c[3]))):
        ordered = sorted(per_copy, key=key)
        copy_source = cupy.asarray(numpy.array([c[5] for c in ordered], dtype=numpy.int32))
        copy_dst = cupy.asarray(numpy.array(
            [(c[0] * experts_per_rank + c[2]) * rows_per_expert
             + first_of_source[c[0] * experts_per_rank + c[2], c[1]] + c[4] for c in ordered], dtype=numpy.int64))
        receiver_first = cupy.asarray(numpy.searchsorted([c[0] for c in ordered], numpy.arange(num_ranks + 1))
                                      .astype(numpy.int32))
        dst.fill(0)  # the orders write the same rows: each is checked on its own writes
        report(f"copy rows per receiver (16 blocks each), {order_name}", 128, dispatch_bytes,
               time_us(lambda: kernels["copy_rows_per_receiver"]((128,), (512,),
                                                                 (src, copy_source, copy_dst, receiver_first, dst,
                                                                  cupy.int32(16), cupy.int32(row_bytes // 16)))))
        written = dst.reshape(-1, row_bytes)[copy_dst]
        assert bool((written == src.reshape(-1, row_bytes)[copy_source]).all()), "copy_rows_per_receiver is wrong"

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.pci_bus_id, "num_sms": num_sms, "iters": args.iters, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
