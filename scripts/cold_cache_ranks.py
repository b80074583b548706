"""How many compiles, and how long, when the ranks of a job start at once on an empty kernel cache.

Each of ``--ranks`` processes (spawned, as a launcher starts them) gets the kernels a Buffer loads,
``kernels.get_cubin`` for every ``low_latency_keys(--arch)`` entry, as ``CudaBackend`` does before
loading the modules, all starting together at a barrier. NVRTC compiles without a GPU, so this runs
on any machine. Reports the compiles summed over the ranks (one per entry is the least) and the
slowest rank's wall time.

    python scripts/cold_cache_ranks.py --ranks 8

A rank that fails ends the run (its exit code named) instead of leaving the others' results waited
for. ``--cache-dir`` must be absent or empty (by default a new temporary folder): the run needs
every entry a miss, and a folder of anything else is not this script's to delete.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import shutil
import tempfile
import time

# How often the parent looks for a rank that exited without its result.
_POLL_S = 1.0


def rank(cache_dir: str, arch: str, barrier, results) -> None:
    from mooncake_ep import kernels

    cache = kernels.KernelCache(cache_dir)
    keys = kernels.low_latency_keys(arch)
    [key.digest for key in keys]  # the digests (NVRTC's version and build) before the clock starts
    barrier.wait()
    start = time.perf_counter()
    compiles = sum(kernels.get_cubin(key, cache)[1] for key in keys)
    results.put((compiles, time.perf_counter() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--cache-dir", default=None,
                        help="an absent or empty folder, so that every entry is a miss (default: a new temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    own_dir = args.cache_dir is None
    if own_dir:
        args.cache_dir = tempfile.mkdtemp(prefix="mooncake_ep_cold_cache_")
    elif os.path.exists(args.cache_dir) and (not os.path.isdir(args.cache_dir) or os.listdir(args.cache_dir)):
        parser.error(f"--cache-dir {args.cache_dir} must be absent or an empty folder (every entry must be a miss)")

    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.ranks), context.Queue()
    processes = [context.Process(target=rank, args=(args.cache_dir, args.arch, barrier, results))
                 for _ in range(args.ranks)]
    for process in processes:
        process.start()
    per_rank = []
    try:
        while len(per_rank) < len(processes):
            try:
                per_rank.append(results.get(timeout=_POLL_S))
            except queue.Empty:
                if any(p.exitcode for p in processes):  # its peers wait at the barrier, or are done: no more
                    break
    finally:
        for process in processes:
            if process.exitcode is None and len(per_rank) < len(processes):
                process.terminate()
            process.join()
        if own_dir:
            shutil.rmtree(args.cache_dir, ignore_errors=True)
    if any(process.exitcode for process in processes):  # before its result, or after it
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in processes]}")
    import mooncake_ep

    report = {"package": mooncake_ep.__file__, "config": vars(args),
              "compiles": sum(compiles for compiles, _ in per_rank),
              "slowest_rank_s": max(seconds for _, seconds in per_rank)}
    print(f"{args.ranks} ranks, {report['compiles']} compiles, slowest rank {report['slowest_rank_s']:.1f} s "
          f"({report['package']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
