"""Time ``Buffer()`` construction with the kernel cache as it is (run after ``warmup`` for warm numbers).

Builds the decode configuration's buffers (8 in-process ranks on GPU 0 by default) several times and
reports the wall time of the collective construction, and of one rank alone. The first round also
pays CUDA context creation and imports; it is reported apart.

    python scripts/time_construction.py --json construction.json
"""

from __future__ import annotations

import argparse
import json
import time

import mooncake_ep as ep
from mooncake_ep import kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    compiled = []
    original = kernels.compile_kernel

    def counting(key):
        compiled.append(key.name)
        return original(key)

    kernels.compile_kernel = counting
    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, args.ranks, args.experts)
    report = {"config": vars(args), "num_ep_buffer_bytes": size, "rounds": []}
    for ranks in (args.ranks, 1):
        for round_index in range(args.rounds):
            group = ep.LocalGroup(ranks, devices=[0] * ranks)
            before = len(compiled)
            start = time.perf_counter()
            buffers = group.spawn(lambda g: ep.Buffer(g, size if ranks == args.ranks else
                                                      ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, 1, 32)))
            elapsed_ms = (time.perf_counter() - start) * 1e3
            group.spawn(lambda g: buffers[g.rank].destroy())
            report["rounds"].append({"ranks": ranks, "round": round_index, "ms": elapsed_ms,
                                     "compiled": len(compiled) - before})
            print(f"ranks={ranks} round {round_index}: {elapsed_ms:.1f} ms, {len(compiled) - before} kernels compiled")
    for ranks in (args.ranks, 1):
        warm = sorted(r["ms"] for r in report["rounds"] if r["ranks"] == ranks and r["round"] > 0)
        report[f"median_warm_ms_ranks{ranks}"] = warm[len(warm) // 2]
        print(f"median construction, ranks={ranks}, rounds after the first: {warm[len(warm) // 2]:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
