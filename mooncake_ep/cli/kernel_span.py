"""Kernel spans of CUDA graph replays, from the CUDA profiler (CUPTI, through ``torch.profiler``).

The benchmark's events time a phase's graph from its origin stream: the graph's launch, its own
nodes at the ends and the join of the rank branches are inside that time, and a graph of 8 kernels
that return at once already takes ~10 us between events on the H200 hosts (docs/performance.md,
(12)). A replay's *kernel span* is what the phase's kernels themselves take: from the first of them
to start to the last to end, over every rank. CUPTI stamps every kernel of a graph with the
correlation id of the graph launch it came from, so one replay's kernels are those of one id. Its
*graph span* runs over every activity of that launch, the benchmark's own nodes at the graph's ends
included: what the graph costs on the GPU, without the launch and the events around it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

# The kernels each benchmark phase launches (kernels_cu/ll_dispatch.cu, ll_combine.cu). A replay of
# a phase is a graph launch that ran its last kernel; its span runs over all of these kernels.
PHASE_KERNELS = {
    "dispatch": ("ll_dispatch",),
    "combine": ("ll_combine",),
    "combine_zero_copy": ("ll_combine",),
    "step": ("ll_dispatch", "ll_combine"),
}


class KernelRecord(NamedTuple):
    """One GPU activity (a kernel, a copy, a fill) as the profiler saw it: device timestamps (ns) and
    the correlation id of the launch it belongs to (for a graph's kernels, the graph launch's)."""

    name: str
    start_ns: int
    end_ns: int
    correlation_id: int


class ReplaySpans(NamedTuple):
    """Per replay, in start order (us): the span of the phase's kernels, and of every activity of
    the replay's graph launch (its end nodes too)."""

    kernels_us: list[float]
    graph_us: list[float]


def replay_spans_us(records: Sequence[KernelRecord], kernel_names: tuple[str, ...], num_replays: int,
                    min_kernels: int) -> ReplaySpans:
    """The spans of each graph launch that ran the phase's kernels.

    Args:
        records: every GPU activity of the profiled replays, of this phase's graphs and any other
            (a combine's replays follow an untimed dispatch replay each).
        kernel_names: the phase's kernels (:data:`PHASE_KERNELS`); the last one marks a launch as
            this phase's, and the kernel span runs from the first start to the last end of any of
            them; the graph span, over every record of the launch.
        num_replays: replays of this phase that were profiled.
        min_kernels: kernels each replay ran at least (one per rank).

    Raises:
        RuntimeError: the records do not hold ``num_replays`` launches of ``min_kernels`` kernels or
            more (the profiler lost records, or did not attribute them to their graph launch): a
            span of the wrong kernels would be a wrong number, not a smaller one.
    """
    launches: dict[int, list[KernelRecord]] = defaultdict(list)
    for record in records:
        launches[record.correlation_id].append(record)
    whole_launches = [group for group in launches.values() if any(r.name == kernel_names[-1] for r in group)]
    whole_launches.sort(key=lambda group: min(r.start_ns for r in group))
    phase_launches = [[r for r in group if r.name in kernel_names] for group in whole_launches]
    short = [len(kernels) for kernels in phase_launches if len(kernels) < min_kernels]
    if len(phase_launches) != num_replays or short:
        seen = sorted({(record.name[:40], record.correlation_id) for record in records})[:6]
        raise RuntimeError(f"kernel span: the profile holds {len(phase_launches)} launches of {kernel_names[-1]} "
                           f"for {num_replays} replays" + (f", {len(short)} of them with fewer than {min_kernels} "
                                                           f"kernels" if short else "") + f"; records: {seen}")

    def span_us(group: list[KernelRecord]) -> float:
        return (max(r.end_ns for r in group) - min(r.start_ns for r in group)) / 1e3

    return ReplaySpans([span_us(kernels) for kernels in phase_launches], [span_us(group) for group in whole_launches])


def profile_kernels(torch, run: Callable[[], None]) -> list[KernelRecord]:
    """Every GPU activity (kernels, copies, fills) ``run()`` launches, with CUPTI's timestamps,
    through ``torch.profiler``.

    Raises:
        RuntimeError: the profiler recorded nothing on the GPU (CUPTI unavailable to this torch).
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:  # one cycle: nothing to clear
        run()
        torch.cuda.synchronize()
    records = [KernelRecord(event.name(), event.start_ns(), event.end_ns(), event.correlation_id())
               for event in prof.profiler.kineto_results.events()
               if event.device_type() == torch.autograd.DeviceType.CUDA]
    if not records:
        raise RuntimeError("kernel span: the CUDA profiler recorded no GPU activity (is CUPTI available to torch?)")
    return records
