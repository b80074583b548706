"""Host (Python) time of eager dispatch and combine calls, and where it goes (cProfile).

One rank with the whole GPU, torch CUDA tensors, the decode shape's per-rank arrays: the host cost
of a call does not depend on the other ranks. Times N calls with results allocated by the call
and with ``out=``, then profiles the allocating calls.

    python scripts/profile_host.py --calls 2000 --json host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import mooncake_ep as ep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    group = ep.LocalGroup(1, devices=[0])
    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, 1, args.experts)
    (buffer,) = group.spawn(lambda g: ep.Buffer(g, size))
    x = torch.randn(args.tokens, args.hidden, device="cuda").to(torch.bfloat16)
    topk = torch.stack([torch.randperm(args.experts, device="cuda")[: args.topk] for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, args.topk, device="cuda")
    active = torch.ones(1, dtype=torch.int32, device="cuda")
    recv_x = torch.empty(args.experts, args.tokens, args.hidden, device="cuda", dtype=torch.float8_e4m3fn)
    recv_scales = torch.empty(args.experts, args.tokens, args.hidden // 128, device="cuda")
    recv_count = torch.empty(args.experts, dtype=torch.int32, device="cuda")
    expert_out = torch.randn(args.experts, args.tokens, args.hidden, device="cuda").to(torch.bfloat16)
    combined = torch.empty(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)

    def step(with_out: bool) -> tuple[float, float]:
        start = time.perf_counter()
        _, _, handle, _, _ = buffer.dispatch(x, topk, active, args.tokens, args.experts,
                                             out=((recv_x, recv_scales), recv_count) if with_out else None)
        middle = time.perf_counter()
        buffer.combine(expert_out, topk, weights, active, -1, handle, out=combined if with_out else None)
        end = time.perf_counter()
        return middle - start, end - middle

    report = {"config": vars(args)}
    for with_out in (False, True):
        for _ in range(50):
            step(with_out)
        torch.cuda.synchronize()
        times = [step(with_out) for _ in range(args.calls)]
        torch.cuda.synchronize()
        times.sort(key=lambda t: t[0] + t[1])
        dispatch_us = sorted(t[0] for t in times)[len(times) // 2] * 1e6
        combine_us = sorted(t[1] for t in times)[len(times) // 2] * 1e6
        key = "out" if with_out else "allocating"
        report[key] = {"dispatch_us_p50": dispatch_us, "combine_us_p50": combine_us}
        print(f"{key:>10}: dispatch {dispatch_us:.1f} us, combine {combine_us:.1f} us per call (host, p50)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        step(False)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    report["profile"] = text.getvalue()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    group.spawn(lambda g: buffer.destroy())


if __name__ == "__main__":
    main()
