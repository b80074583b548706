"""How long a survivor loses when a rank stops: the masked call's time against timeout_us.

In-process ranks on one GPU (the decode shape by default). For each timeout and each phase, one
rank stops launching (before dispatch, or after dispatch before combine); every survivor times its
own call with CUDA events on its own stream. The same call with every rank alive is the baseline.
Lost time = masked call - baseline call; the claim is lost <= timeout_us + a small constant.

    python scripts/fault_latency.py --json fault.json
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import mooncake_ep as ep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--timeouts-us", default="1000,5000,20000")
    parser.add_argument("--dead-rank", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    timeouts = [int(t) for t in args.timeouts_us.split(",")]
    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, args.ranks, args.experts)
    group = ep.LocalGroup(args.ranks, devices=[0] * args.ranks)

    def run(g):
        rng = np.random.default_rng(g.rank)
        x = torch.randn(args.tokens, args.hidden, device="cuda").to(torch.bfloat16)
        topk = torch.from_numpy(np.stack([rng.choice(args.experts, args.topk, replace=False)
                                          for _ in range(args.tokens)])).cuda()
        weights = torch.rand(args.tokens, args.topk, device="cuda")
        num_local = args.experts // args.ranks
        expert_out = torch.randn(num_local, args.ranks * args.tokens, args.hidden, device="cuda").to(torch.bfloat16)
        stream = torch.cuda.current_stream()

        def settle():
            stream.synchronize()
            g.barrier()

        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3

        rows = []
        cases = [(-1, "none")] + [(t, phase) for t in timeouts for phase in ("dispatch", "combine")]
        for timeout_us, dead_phase in cases:
            # A fresh buffer per case: a rank that skipped dispatches is behind its peers' parity,
            # and only a new Buffer (a replacement) catches up with them.
            buffer = ep.Buffer(g, size, num_sms=args.num_sms)
            for _ in range(args.repeats):
                active = torch.ones(args.ranks, dtype=torch.int32, device="cuda")
                dead = g.rank == args.dead_rank and dead_phase != "none"
                settle()
                if dead and dead_phase == "dispatch":
                    for _ in range(2):
                        settle()
                    continue
                handle = []
                dispatch_us = timed(lambda: handle.append(buffer.dispatch(
                    x, topk, active, args.tokens, args.experts, timeout_us=timeout_us)[2]))
                settle()
                if dead:
                    settle()
                    continue
                combine_us = timed(lambda: buffer.combine(expert_out, topk, weights, active, timeout_us, handle[0]))
                settle()
                rows.append(dict(timeout_us=timeout_us, dead_phase=dead_phase, dispatch_us=dispatch_us,
                                 combine_us=combine_us, masked=int(args.ranks - int(active.sum()))))
            buffer.destroy()
        return rows

    per_rank = group.spawn(run)
    survivors = [r for r in range(args.ranks) if r != args.dead_rank]
    rows = [row for r in survivors for row in per_rank[r]]
    base = {phase: float(np.median([row[f"{phase}_us"] for row in rows if row["dead_phase"] == "none"]))
            for phase in ("dispatch", "combine")}
    report = {"config": vars(args), "baseline_us": base, "cases": []}
    print(f"baseline (every rank alive): dispatch {base['dispatch']:.1f} us, combine {base['combine']:.1f} us")
    print(f"{'timeout us':>10}{'rank stops':>12}{'phase':>10}{'max us':>10}{'lost us':>10}{'over timeout':>14}{'masked':>8}")
    for timeout_us in timeouts:
        for dead_phase in ("dispatch", "combine"):
            chosen = [row for row in rows if row["timeout_us"] == timeout_us and row["dead_phase"] == dead_phase]
            phase = dead_phase  # the call that waits for the stopped rank
            worst = max(row[f"{phase}_us"] for row in chosen)
            lost = worst - base[phase]
            masked = sorted({row["masked"] for row in chosen})
            report["cases"].append(dict(timeout_us=timeout_us, dead_phase=dead_phase, worst_us=worst, lost_us=lost,
                                        over_timeout_us=lost - timeout_us, masked=masked))
            print(f"{timeout_us:>10}{'before ' + dead_phase:>12}{phase:>10}{worst:>10.1f}{lost:>10.1f}"
                  f"{lost - timeout_us:>14.1f}{str(masked):>8}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
