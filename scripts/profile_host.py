"""Host (Python) time of dispatch and combine calls per framework, eager and in a graph / jit.

One rank with the whole GPU and the decode shape's per-rank work (T = 128 tokens of H = 7168, top-8 of
32 local experts: 1024 copies in, 1024 rows combined): the host cost of a call does not depend on the
other ranks. fp8 dispatch, bf16 combine. Per framework:

- ``torch`` / ``cupy`` eager: p50 host time of a dispatch and of a combine call, with results
  allocated by the call and with ``out=``;
- ``torch`` graph: a dispatch -> combine step captured with ``torch.cuda.graph``; the host time of
  ``replay()`` and the step time (``--steps`` replays back to back, wall time / steps);
- ``jax`` eager: the host time of ``mooncake_ep.jax.dispatch`` and ``combine`` called outside ``jax.jit``
  (each runs as its own cached jitted program);
- ``jax`` jit: the same step under ``jax.jit``: host time of the call (it returns before the GPU is
  done) and the step time as for the graph. The target: within 10% of the torch graph's step time.
  For scale, the same for XLA alone: a program of one fusion on the same operands (what any
  execution costs), and per layer of programs of ``--layers`` layers, with and without our ops.
  By default XLA records the step into a command buffer (a CUDA graph, ``--xla_gpu_enable_command_buffer``
  with custom calls), so the Python callbacks run only when it records; ``--no-command-buffers``
  measures the plain path, where every execution calls back into Python.

``--profile`` adds a cProfile of torch's allocating eager calls (where the microseconds go).

    python scripts/profile_host.py --frameworks torch cupy jax --json host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np

import mooncake_ep as ep
from mooncake_ep.cli.gpu import gpu_status

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch and cupy


def p50_us(call: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``call()`` in microseconds (the GPU work it queues is not waited for)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def step_us(call: Callable[[], object], wait: Callable[[], object], steps: int) -> float:
    """Wall time per call of ``steps`` calls back to back, waited for at the end: the step time."""
    wait()
    start = time.perf_counter()
    for _ in range(steps):
        call()
    wait()
    return (time.perf_counter() - start) / steps * 1e6


def pair_p50_us(dispatch: Callable[[], object], combine: Callable[[], object], wait: Callable[[], object],
                repeats: int, rounds: int = 1) -> dict:
    """Median host time of each call of ``repeats`` dispatch-then-combine pairs, in microseconds.

    Pairs, because a dispatch's handle must be combined before the dispatch after next. The pairs
    run in ``rounds`` rounds (1 <= rounds <= repeats) of nearly equal size: besides the median of
    every call, each round's median (``*_us_rounds``) and the least disturbed one of each call
    (``*_us_best_round``). The H200 hosts are shared: the same code's median moved 27-60 us between
    runs seconds apart, and a round that the machine's other work slowed down then shows as an
    outlier instead of shifting the whole number.
    """
    wait()
    dispatch_times, combine_times = [], []
    dispatch_rounds, combine_rounds = [], []
    for size in (repeats // rounds + (r < repeats % rounds) for r in range(rounds)):
        first = len(dispatch_times)
        for _ in range(size):
            start = time.perf_counter()
            dispatch()
            middle = time.perf_counter()
            combine()
            dispatch_times.append(middle - start)
            combine_times.append(time.perf_counter() - middle)
        wait()
        dispatch_rounds.append(statistics.median(dispatch_times[first:]) * 1e6)
        combine_rounds.append(statistics.median(combine_times[first:]) * 1e6)
    return {"dispatch_us_p50": statistics.median(dispatch_times) * 1e6,
            "combine_us_p50": statistics.median(combine_times) * 1e6,
            "dispatch_us_best_round": min(dispatch_rounds), "combine_us_best_round": min(combine_rounds),
            "dispatch_us_rounds": dispatch_rounds, "combine_us_rounds": combine_rounds}


class Shape:
    def __init__(self, args: argparse.Namespace):
        self.tokens, self.hidden, self.topk, self.experts = args.tokens, args.hidden, args.topk, args.experts
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((self.tokens, self.hidden), dtype=np.float32)
        self.topk_idx = np.stack([rng.permutation(self.experts)[: self.topk] for _ in range(self.tokens)])
        self.weights = rng.random((self.tokens, self.topk), dtype=np.float32)
        self.expert_out = rng.standard_normal((self.experts, self.tokens, self.hidden), dtype=np.float32)


def eager_times(buffer: ep.Buffer, shape: Shape, arrays: dict, outs: dict, repeats: int, rounds: int) -> dict:
    """Host time of eager dispatch and combine calls, allocating and with ``out=``."""
    report = {}
    for key, with_out in (("allocating", False), ("out", True)):
        state = {}

        def dispatch():
            state["handle"] = buffer.dispatch(arrays["x"], arrays["topk"], arrays["active"], shape.tokens,
                                              shape.experts, out=outs["dispatch"] if with_out else None)[2]

        def combine():
            buffer.combine(arrays["expert_out"], arrays["topk"], arrays["weights"], arrays["active"],
                           handle=state["handle"], out=outs["combine"] if with_out else None)

        for _ in range(50):
            dispatch()
            combine()
        report[key] = pair_p50_us(dispatch, combine, arrays["sync"], repeats, rounds)
    return report


def torch_report(buffer: ep.Buffer, shape: Shape, args: argparse.Namespace) -> dict:
    import torch

    def to(a, dtype):
        return torch.from_numpy(a).cuda().to(dtype)

    arrays = dict(x=to(shape.x, torch.bfloat16), topk=to(shape.topk_idx, torch.int64),
                  weights=to(shape.weights, torch.float32), active=torch.ones(1, dtype=torch.int32, device="cuda"),
                  expert_out=to(shape.expert_out, torch.bfloat16), sync=torch.cuda.synchronize)
    e, t, h = shape.experts, shape.tokens, shape.hidden
    outs = dict(dispatch=((torch.empty(e, t, h, device="cuda", dtype=torch.float8_e4m3fn),
                           torch.empty(e, t, h // 128, device="cuda")),
                          torch.empty(e, dtype=torch.int32, device="cuda")),
                combine=torch.empty(t, h, device="cuda", dtype=torch.bfloat16))
    report = {"eager": eager_times(buffer, shape, arrays, outs, args.calls, args.rounds)}

    def step():
        handle = buffer.dispatch(arrays["x"], arrays["topk"], arrays["active"], t, e, out=outs["dispatch"])[2]
        buffer.combine(arrays["expert_out"], arrays["topk"], arrays["weights"], arrays["active"], handle=handle,
                       out=outs["combine"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # plans and allocations happen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(20):
        graph.replay()
    report["graph"] = {"replay_us_p50": p50_us(graph.replay, args.calls),
                       "step_us": step_us(graph.replay, torch.cuda.synchronize, args.steps)}
    report["eager_step_us"] = step_us(step, torch.cuda.synchronize, args.steps)

    def layers():  # the MoE layers of one forward: each combine's output is the next dispatch's input
        x = arrays["x"]
        for _ in range(args.layers):
            handle = buffer.dispatch(x, arrays["topk"], arrays["active"], t, e, out=outs["dispatch"])[2]
            buffer.combine(arrays["expert_out"], arrays["topk"], arrays["weights"], arrays["active"], handle=handle,
                           out=outs["combine"])
            x = outs["combine"]

    with torch.cuda.stream(side):
        layers()
    torch.cuda.current_stream().wait_stream(side)
    layered = torch.cuda.CUDAGraph()
    with torch.cuda.graph(layered):
        layers()
    layered.replay()
    report["graph"]["layer_us"] = step_us(layered.replay, torch.cuda.synchronize, args.steps) / args.layers
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        eager_times(buffer, shape, arrays, outs, args.calls, args.rounds)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        report["profile"] = text.getvalue()
    return report


def cupy_report(buffer: ep.Buffer, shape: Shape, args: argparse.Namespace) -> dict:
    import cupy
    import ml_dtypes

    def bf16_bits(a):  # cupy has no bfloat16: it carries the raw bits as uint16
        return cupy.asarray(a.astype(ml_dtypes.bfloat16).view(np.uint16))

    arrays = dict(x=bf16_bits(shape.x), topk=cupy.asarray(shape.topk_idx.astype(np.int64)),
                  weights=cupy.asarray(shape.weights), active=cupy.ones(1, dtype=cupy.int32),
                  expert_out=bf16_bits(shape.expert_out),
                  sync=cupy.cuda.Device().synchronize)
    e, t, h = shape.experts, shape.tokens, shape.hidden
    outs = dict(dispatch=((cupy.empty((e, t, h), dtype=cupy.uint8), cupy.empty((e, t, h // 128), dtype=cupy.float32)),
                          cupy.empty(e, dtype=cupy.int32)),
                combine=cupy.empty((t, h), dtype=cupy.uint16))
    return {"eager": eager_times(buffer, shape, arrays, outs, args.calls, args.rounds)}


def jax_report(buffer: ep.Buffer, shape: Shape, args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp

    import mooncake_ep.jax as epj

    device = jax.devices("gpu")[0]
    put = lambda a, dtype: jax.device_put(jnp.asarray(a, dtype), device)  # noqa: E731
    x, topk, weights = put(shape.x, jnp.bfloat16), put(shape.topk_idx, jnp.int32), put(shape.weights, jnp.float32)
    active, expert_out = put(np.ones(1), jnp.int32), put(shape.expert_out, jnp.bfloat16)
    t, e = shape.tokens, shape.experts
    state = {}

    def dispatch():
        _, _, state["handle"], state["active"] = epj.dispatch(buffer, x, topk, active, t, e)

    def combine():
        state["out"], _ = epj.combine(buffer, expert_out, topk, weights, state["active"], state["handle"])

    def step(x, topk, weights, active, expert_out):
        _, _, handle, active = epj.dispatch(buffer, x, topk, active, t, e)
        return epj.combine(buffer, expert_out, topk, weights, active, handle)

    def layers(x, topk, weights, active, expert_out):  # as torch_report's layers(), in one program
        for _ in range(args.layers):
            _, _, handle, active = epj.dispatch(buffer, x, topk, active, t, e)
            x, active = epj.combine(buffer, expert_out, topk, weights, active, handle)
        return x, active

    def plain_layers(x, topk, weights, active, expert_out, num_layers=args.layers):  # XLA alone: a fusion per layer
        for _ in range(num_layers):
            x = (x * weights[:, :1].astype(x.dtype) + expert_out[0]).astype(x.dtype)
        return x, active

    def plain_step(x, topk, weights, active, expert_out):  # XLA's own cost of executing a program of these operands
        return plain_layers(x, topk, weights, active, expert_out, num_layers=1)

    jitted = jax.jit(step)
    wait = lambda: jax.block_until_ready(state.get("out"))  # noqa: E731

    def jit_call():
        state["out"] = jitted(x, topk, weights, active, expert_out)

    for _ in range(20):
        dispatch()
        combine()
        jit_call()
    eager = pair_p50_us(dispatch, combine, wait, args.calls, args.rounds)
    # How often the ops' Python callbacks still run per jitted step: each one builds a launch
    # (Buffer._*_launcher). With command buffers replaying, it is ~0; every execution, 2.
    launches = []
    for name in ("_dispatch_launcher", "_combine_launcher"):
        real = getattr(buffer, name)
        setattr(buffer, name, lambda *a, _real=real, **k: launches.append(1) or _real(*a, **k))

    def jit_call_released():
        # The last step's outputs dropped before this one allocates its own: XLA may then hand out
        # the same addresses every step, and a command buffer whose addresses did not change needs
        # no update. Holding the last result (jit_call) is what a training loop's carried state does.
        state["out"] = None
        state["out"] = jitted(x, topk, weights, active, expert_out)

    jit = {"call_us_p50": p50_us(jit_call, args.calls), "step_us": step_us(jit_call, wait, args.steps)}
    jit["callbacks_per_step"] = len(launches) / (args.calls + args.steps)
    jit["step_released_us"] = step_us(jit_call_released, wait, args.steps)
    for key, fn, num_layers in (("layer", layers, args.layers), ("plain_xla_layer", plain_layers, args.layers),
                                ("plain_xla_step", plain_step, 1)):
        program = jax.jit(fn)

        def program_call(program=program):
            state["out"] = program(x, topk, weights, active, expert_out)[0]

        for _ in range(20):  # traces, compiles and records
            program_call()
        launches.clear()
        jit[f"{key}_us"] = step_us(program_call, wait, args.steps) / num_layers
        jit[f"{key}_callbacks"] = len(launches) / (args.steps * num_layers)
    # The host time of a call of the one-fusion program: what XLA itself spends per execution.
    jit["plain_xla_call_us_p50"] = p50_us(program_call, args.calls)

    def program_call_released():
        state["out"] = None
        program_call()

    jit["plain_xla_step_released_us"] = step_us(program_call_released, wait, args.steps)
    for name in ("_dispatch_launcher", "_combine_launcher"):
        delattr(buffer, name)
    return {"eager": eager, "jit": jit}


REPORTS = {"torch": torch_report, "cupy": cupy_report, "jax": jax_report}


def summary(name: str, report: dict) -> list[str]:
    lines = []
    for key, eager in report["eager"].items() if name != "jax" else [("eager", report["eager"])]:
        lines.append(f"{name:>5} {key:>10}: dispatch {eager['dispatch_us_p50']:6.1f} us, "
                     f"combine {eager['combine_us_p50']:6.1f} us (host, p50; best of "
                     f"{len(eager['dispatch_us_rounds'])} rounds {eager['dispatch_us_best_round']:.1f} / "
                     f"{eager['combine_us_best_round']:.1f} us)")
    if "graph" in report:
        g = report["graph"]
        lines.append(f"{name:>5}      graph: replay {g['replay_us_p50']:6.1f} us (host), step {g['step_us']:6.1f} us;"
                     f" eager step {report['eager_step_us']:6.1f} us; per layer of a layered graph {g['layer_us']:6.1f} us")
    if "jit" in report:
        j = report["jit"]
        lines.append(f"{name:>5}        jit: call {j['call_us_p50']:6.1f} us (host), step {j['step_us']:6.1f} us, "
                     f"{j['callbacks_per_step']:.2f} Python callbacks per step; per layer of a layered program "
                     f"{j['layer_us']:6.1f} us (XLA alone, a fusion per layer: {j['plain_xla_layer_us']:6.1f} us)")
        lines.append(f"{name:>5}   XLA alone: a one-fusion program of the same operands: call "
                     f"{j['plain_xla_call_us_p50']:6.1f} us (host), step {j['plain_xla_step_us']:6.1f} us")
        lines.append(f"{name:>5}   last step's outputs dropped before each call: step {j['step_released_us']:6.1f} us, "
                     f"XLA alone {j['plain_xla_step_released_us']:6.1f} us")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frameworks", nargs="+", choices=sorted(REPORTS), default=["torch", "cupy", "jax"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per measurement")
    parser.add_argument("--rounds", type=int, default=5,
                        help="eager calls run in this many rounds; the least disturbed round's median is reported too")
    parser.add_argument("--steps", type=int, default=500, help="back-to-back steps for a step time")
    parser.add_argument("--layers", type=int, default=8,
                        help="MoE layers in one graph / jitted program, for the per-layer step time")
    parser.add_argument("--profile", action="store_true", help="cProfile torch's allocating eager calls")
    parser.add_argument("--no-command-buffers", dest="command_buffers", action="store_false",
                        help="JAX: no XLA command buffers (every execution runs the Python callbacks)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not 1 <= args.rounds <= args.calls:
        parser.error(f"--rounds must be in [1, --calls={args.calls}], got {args.rounds}")
    if args.command_buffers:  # read when JAX starts its GPU backend, which happens later, in jax_report
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_graph_min_graph_size=1"
                                   " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL").strip()
    usable, reason = gpu_status()
    if not usable:
        parser.exit(2, f"profile_host.py measures the GPU path: {reason}\n")

    shape = Shape(args)
    group = ep.LocalGroup(1, devices=[0])
    size = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, 1, args.experts)
    (buffer,) = group.spawn(lambda g: ep.Buffer(g, size))
    report = {"config": vars(args)}
    try:
        for name in args.frameworks:
            report[name] = REPORTS[name](buffer, shape, args)
            print("\n".join(summary(name, report[name])), flush=True)
    finally:
        group.spawn(lambda g: buffer.destroy())
    if "profile" in report.get("torch", {}):
        print(report["torch"]["profile"])
    print("\n".join(line for name in args.frameworks for line in summary(name, report[name])))
    if "torch" in report and "jax" in report:
        ratio = report["jax"]["jit"]["step_us"] / report["torch"]["graph"]["step_us"]
        report["jax_jit_over_torch_graph_step"] = ratio
        print(f"jax jit step / torch graph step: {ratio:.3f} (target <= 1.10)")
        layer_ratio = report["jax"]["jit"]["layer_us"] / report["torch"]["graph"]["layer_us"]
        report["jax_jit_over_torch_graph_layer"] = layer_ratio
        print(f"per layer of {args.layers}-layer programs, jax jit / torch graph: {layer_ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
