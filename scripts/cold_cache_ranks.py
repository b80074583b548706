"""How many compiles, and how long, when the ranks of a job start at once on an empty kernel cache.

Each of ``--ranks`` processes (spawned, as a launcher starts them) gets the kernels a Buffer loads,
``kernels.get_cubin`` for every ``low_latency_keys(--arch)`` entry, as ``CudaBackend`` does before
loading the modules, all starting together at a barrier. NVRTC compiles without a GPU, so this runs
on any machine. Reports the compiles summed over the ranks (one per entry is the least) and the
slowest rank's wall time.

    python scripts/cold_cache_ranks.py --ranks 8 --cache-dir /tmp/cold-cache
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import time


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
    parser.add_argument("--cache-dir", required=True, help="emptied first: every entry is a miss")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    shutil.rmtree(args.cache_dir, ignore_errors=True)
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.ranks), context.Queue()
    processes = [context.Process(target=rank, args=(args.cache_dir, args.arch, barrier, results))
                 for _ in range(args.ranks)]
    for process in processes:
        process.start()
    per_rank = [results.get() for _ in processes]
    for process in processes:
        process.join()
    if any(process.exitcode for process in processes):
        raise SystemExit(f"a rank failed: exit codes {[process.exitcode for process in processes]}")
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
