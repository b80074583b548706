"""mooncake_ep.deep_ep on the CPU: DeepEP's low-latency calls, made as DeepEP's callers make them, equal
mooncake_ep.reference; what DeepEP has and mooncake_ep has not is refused by name.

The ranks are threads of a LocalGroup with CPU tensors (the numpy reference runs the collectives).
"""

from __future__ import annotations

import numpy as np
import pytest
from _cases import BF16, bits, make_case, reference_step

import mooncake_ep as ep
from mooncake_ep._handshake import RankMismatchError

torch = pytest.importorskip("torch")
deep_ep = pytest.importorskip("mooncake_ep.deep_ep")

GROUP_TIMEOUT_S = 30.0


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == BF16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def new_buffer(group, case, **kwargs) -> deep_ep.Buffer:
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(case.num_max_tokens, case.hidden, case.num_ranks,
                                                                   case.num_experts)
    return deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=case.num_local_experts,
                          backend="reference", **kwargs)


def expert_outputs(case, seed: int) -> list[np.ndarray]:
    """Each rank's expert outputs, ``[E_l, R*T, H]`` bf16, random (rows past recv_count too)."""
    rng = np.random.default_rng(seed)
    shape = (case.num_local_experts, case.num_ranks * case.num_max_tokens, case.hidden)
    return [rng.standard_normal(shape).astype(np.float32).astype(BF16) for _ in range(case.num_ranks)]


def logged_stream_and_event(log: list):
    """CUDA stand-ins that log what is done with them: a stream made with a name, whose waits are
    logged, and an event whose records are."""
    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append(("wait", self.name, event))

    class Event:
        def record(self, stream):
            log.append(("record", stream.name, self))

    return Stream, Event


FLAGS = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
         "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}


@pytest.mark.parametrize("mode", ["sync", "async_finish", "return_recv_hook", "zero_copy"])
@pytest.mark.parametrize("precision", sorted(FLAGS))
def test_deepep_calls_equal_the_reference(precision, mode):
    """Two dispatch + combine steps as DeepEP's tests make them, with cumulative_local_expert_recv_stats:
    results equal the reference bit for bit, and the stats grow by recv_count each step."""
    flags = FLAGS[precision]
    case = make_case(7, num_ranks=3, num_max_tokens=4, hidden=256, num_experts=6, num_topk=3)
    outs = expert_outputs(case, 8)
    expected, expected_combined = reference_step(case, flags, lambda rank, result, flags: outs[rank])
    stats_start = np.random.default_rng(9).integers(0, 1000, size=case.num_local_experts).astype(np.int32)

    def rank_fn(group):
        rank = group.rank
        buffer = new_buffer(group, case)
        x, topk_idx, topk_weights = (to_torch(a[rank]) for a in (case.xs, case.topk_idxs, case.weights))
        # In two modes made as an engine may make it, under inference mode: the adds happen outside it.
        with torch.inference_mode(mode in ("sync", "return_recv_hook")):
            stats = to_torch(stats_start)
        steps = []
        for _ in range(2):  # both workspace halves
            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                x, topk_idx, case.num_max_tokens, case.num_experts, stats, None, **flags,
                async_finish=mode == "async_finish", return_recv_hook=mode == "return_recv_hook")
            if hook is not None:
                hook()
            event.current_stream_wait()
            dispatched = (recv_x if flags["use_fp8"] else (recv_x, None), recv_count.clone())
            if mode == "zero_copy":
                buffer.get_next_low_latency_combine_buffer(handle).copy_(to_torch(outs[rank]))
            combined, event, hook = buffer.low_latency_combine(
                None if mode == "zero_copy" else to_torch(outs[rank]), topk_idx, topk_weights, handle,
                zero_copy=mode == "zero_copy", async_finish=mode == "async_finish",
                return_recv_hook=mode == "return_recv_hook")
            if hook is not None:
                hook()
            event.current_stream_wait()
            steps.append((dispatched, combined))
        return steps, stats.numpy() - stats_start

    for rank, (steps, stats_growth) in enumerate(ep.LocalGroup(case.num_ranks, timeout_s=GROUP_TIMEOUT_S)
                                                 .spawn(rank_fn)):
        ref = expected[rank]
        for ((recv_x, recv_scales), recv_count), combined in steps:
            np.testing.assert_array_equal(recv_count.numpy(), ref.recv_count, err_msg=f"rank {rank}")
            for e, count in enumerate(ref.recv_count):
                np.testing.assert_array_equal(bits(recv_x[e, :count].view(torch.uint8 if flags["use_fp8"]
                                                                           else torch.int16).numpy()),
                                              bits(ref.recv_x[e, :count]), err_msg=f"rank {rank} expert {e}")
                if recv_scales is not None:
                    np.testing.assert_array_equal(recv_scales[e, :count].numpy(), ref.recv_scales[e, :count])
            np.testing.assert_array_equal(bits(combined.view(torch.int16).numpy()), bits(expected_combined[rank][0]),
                                          err_msg=f"rank {rank}: combined")
        np.testing.assert_array_equal(stats_growth, 2 * ref.recv_count, err_msg=f"rank {rank}: recv stats")


def test_the_mask_buffer_is_active_ranks():
    """low_latency_update_mask_buffer masks a rank for the next calls (equal to the reference with that
    mask), low_latency_query_mask_buffer reads the masks back, low_latency_clean_mask_buffer admits all."""
    masked = [[1, 0, 1], [1, 1, 1], [1, 0, 1]]
    case = make_case(11, num_ranks=3, num_max_tokens=3, hidden=128, num_experts=3, num_topk=2, actives=masked)
    outs = expert_outputs(case, 12)
    _, expected_combined = reference_step(case, FLAGS["bf16"], lambda rank, result, flags: outs[rank])

    def rank_fn(group):
        rank = group.rank
        buffer = new_buffer(group, case, enable_shrink=True)
        if rank != 1:
            buffer.low_latency_update_mask_buffer(1, True)
        status = torch.full((3,), -1, dtype=torch.int32)
        buffer.low_latency_query_mask_buffer(status)
        x, topk_idx, topk_weights = (to_torch(a[rank]) for a in (case.xs, case.topk_idxs, case.weights))
        _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, case.num_max_tokens, case.num_experts,
                                                         use_fp8=False)
        combined, _, _ = buffer.low_latency_combine(to_torch(outs[rank]), topk_idx, topk_weights, handle)
        buffer.low_latency_clean_mask_buffer()
        after_clean = torch.full((3,), -1, dtype=torch.int32)
        buffer.low_latency_query_mask_buffer(after_clean)
        return status.tolist(), combined, after_clean.tolist(), buffer.active_ranks.tolist()

    for rank, (status, combined, after_clean, active) in enumerate(
            ep.LocalGroup(3, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)):
        assert status == [1 - a for a in masked[rank]]
        np.testing.assert_array_equal(bits(combined.view(torch.int16).numpy()), bits(expected_combined[rank][0]))
        assert after_clean == [0, 0, 0] and active == [1, 1, 1]


def test_a_bad_timeout_is_refused_before_the_collective_construction(monkeypatch):
    """timeout_us was checked after the runtime Buffer's handshake: the refusing rank left its peers a
    Buffer whose partner had none, and its own was never destroyed (helper-144)."""
    case = make_case(13, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    group = ep.LocalGroup(1).rank_group(0)
    monkeypatch.setattr(deep_ep, "_Buffer", lambda *args, **kwargs: pytest.fail("built before the checks"))
    with pytest.raises(ValueError, match=r"^deep_ep.Buffer: timeout_us must be >= -1, got -5"):
        deep_ep.Buffer(group, 0, case.size_hint, low_latency_mode=True, backend="reference", timeout_us=-5)


def test_what_deepep_has_and_mooncake_ep_has_not_is_refused_by_name():
    case = make_case(13, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    group = ep.LocalGroup(1).rank_group(0)
    with pytest.raises(ValueError, match=r"^deep_ep.Buffer: low_latency_mode must be True: mooncake_ep builds "
                                         r"DeepEP's low-latency mode only"):
        deep_ep.Buffer(group, 1 << 20, 0, backend="reference")
    with pytest.raises(ValueError, match=r"^deep_ep.Buffer: group or comm must be given"):
        new_buffer(None, case)
    with pytest.raises(ValueError, match=r"num_qps_per_rank must be >= 1, got 0"):
        deep_ep.Buffer(group, 0, case.size_hint, True, 0, backend="reference")
    with pytest.raises(TypeError, match=r"enable_shrink must be a bool, got str"):
        new_buffer(group, case, enable_shrink="yes")
    with pytest.raises(ValueError, match=r"^deep_ep.Buffer: num_rdma_bytes must be >= \d+, got 0"):  # DeepEP's default
        deep_ep.Buffer(group, 0, 0, low_latency_mode=True, backend="reference")

    buffer = new_buffer(group, case)
    shrink = new_buffer(group, case, enable_shrink=True)
    x, topk_idx, topk_weights = (to_torch(a[0]) for a in (case.xs, case.topk_idxs, case.weights))
    T, E = case.num_max_tokens, case.num_experts
    refusals = [
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, False), TypeError,
         r"cumulative_local_expert_recv_stats must be an int32 torch.Tensor or None, got bool \(DeepEP's older API "
         r"had use_fp8 fifth: pass it by name\)"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, torch.zeros(2, dtype=torch.int64)), ValueError,
         r"must be a contiguous \[2\] int32 tensor \(one count per local expert\), got \[2\] torch.int64"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, torch.zeros(3, dtype=torch.int32)), ValueError,
         r"must be a contiguous \[2\] int32 tensor"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, dispatch_wait_recv_cost_stats=torch.zeros(1)),
         NotImplementedError, r"dispatch_wait_recv_cost_stats must be None: mooncake_ep's kernels do not measure"),
        # DeepEP's order before its wait-time diagnostics: use_fp8 sixth, after the stats.
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, None, False), TypeError,
         r"dispatch_wait_recv_cost_stats got a bool \(DeepEP's older API had use_fp8 sixth, after "
         r"cumulative_local_expert_recv_stats: pass it by name\)"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, use_ue8m0=True), ValueError,
         r"low_latency_dispatch: use_ue8m0=True needs round_scale=True \(as DeepEP's\)"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, round_scale=None), TypeError,
         r"low_latency_dispatch: round_scale must be a bool, got NoneType"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, async_finish=torch.tensor(True)), TypeError,
         r"low_latency_dispatch: async_finish must be a bool, got torch.Tensor"),
        # The oldest order, use_fp8 fifth and round_scale sixth: the fifth's hint.
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, True, False), TypeError,
         r"cumulative_local_expert_recv_stats must be an int32 torch.Tensor or None, got bool \(DeepEP's older API "
         r"had use_fp8 fifth"),
        (lambda: buffer.low_latency_dispatch(case.xs[0], topk_idx, T, E), TypeError,
         r"low_latency_dispatch: x must be a torch.Tensor \(DeepEP's API takes torch tensors"),
        (lambda: buffer.low_latency_dispatch(x, topk_idx, T, 3), ValueError, r"num_experts"),
        # The runtime's own checks, named by DeepEP's method (they read "dispatch: ...").
        (lambda: buffer.low_latency_dispatch(x.t(), topk_idx, T, E), ValueError, r"^low_latency_dispatch: x must be"),
        (lambda: buffer.dispatch(x, topk_idx=topk_idx), NotImplementedError,
         r"deep_ep.Buffer.dispatch: DeepEP's high-throughput mode is not built in mooncake_ep"),
        (lambda: buffer.get_dispatch_layout(topk_idx, E), NotImplementedError, r"get_dispatch_layout"),
        (lambda: deep_ep.Buffer.get_dispatch_config(8), NotImplementedError, r"get_dispatch_config"),
        (lambda: deep_ep.Buffer.get_combine_config(8), NotImplementedError, r"get_combine_config"),
        (lambda: deep_ep.Config(24, 6, 256).get_nvl_buffer_size_hint(7168 * 2, 8), NotImplementedError,
         r"deep_ep.Config.get_nvl_buffer_size_hint: DeepEP's high-throughput mode"),
        (lambda: buffer.get_comm_stream(), RuntimeError, r"reference backend, which has no stream"),
        (lambda: buffer.clean_low_latency_buffer(T * 2, case.hidden, E), ValueError,
         r"clean_low_latency_buffer: num_rdma_bytes=\d+ is smaller than the \d+ bytes of T=8"),
        # DeepEP asserts "Shrink mode must be enabled": a peer still counting a masked rank live would
        # wait for it forever (no timeout without enable_shrink).
        (lambda: buffer.low_latency_update_mask_buffer(0, True), RuntimeError,
         r"^low_latency_update_mask_buffer: the mask buffer needs enable_shrink=True.* wait for it forever"),
        (lambda: buffer.low_latency_query_mask_buffer(torch.zeros(1, dtype=torch.int32)), RuntimeError,
         r"^low_latency_query_mask_buffer: the mask buffer needs enable_shrink=True"),
        (lambda: buffer.low_latency_clean_mask_buffer(), RuntimeError,
         r"^low_latency_clean_mask_buffer: the mask buffer needs enable_shrink=True"),
        (lambda: shrink.low_latency_update_mask_buffer(1, True), ValueError, r"rank_to_mask must be < group_size=1"),
        (lambda: shrink.low_latency_update_mask_buffer(0, 0.0), TypeError, r"mask must be a bool, got float"),
        (lambda: shrink.low_latency_query_mask_buffer(torch.zeros(1)), ValueError,
         r"mask_status must be \[1\] int32, got \[1\] torch.float32"),
        (lambda: deep_ep.Buffer.set_num_sms(23), ValueError, r"new_num_sms must be even"),
    ]
    for call, exc, pattern in refusals:
        with pytest.raises(exc, match=pattern):
            call()
    assert hasattr(buffer, "get_dispatch_layout")  # there, as in DeepEP: it is calling it that is refused
    with pytest.raises(AttributeError, match="no attribute 'low_latency_dispach'"):
        buffer.low_latency_dispach  # noqa: B018 (a typo stays an AttributeError)

    # After every refusal the buffer works, and combine's refusals come after a real dispatch.
    buffer.clean_low_latency_buffer(T, case.hidden, E)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    out = recv_x.float().mul(2).to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"use_logfmt=True \(DeepEP's LogFMT-compressed combine\) is not "
                                                  r"built; bf16 is sent \(DeepEP's older API had zero_copy fifth"):
        buffer.low_latency_combine(out, topk_idx, topk_weights, handle, True)
    with pytest.raises(NotImplementedError, match=r"combine_wait_recv_cost_stats must be None"):
        buffer.low_latency_combine(out, topk_idx, topk_weights, handle, combine_wait_recv_cost_stats=torch.zeros(1))
    with pytest.raises(ValueError, match=r"^low_latency_combine: out combined_x must have shape"):
        buffer.low_latency_combine(out, topk_idx, topk_weights, handle, out=torch.empty(1, case.hidden,
                                                                                        dtype=torch.bfloat16))
    combined, _, _ = buffer.low_latency_combine(out, topk_idx, topk_weights, handle)
    live = topk_idx >= 0
    expected = (2 * x.float() * (topk_weights * live).sum(1, keepdim=True)).to(torch.bfloat16)  # one rank: its own
    torch.testing.assert_close(combined, expected, rtol=2**-7, atol=1e-2)


def test_static_helpers_are_deepep_s():
    assert deep_ep.topk_idx_t == torch.int64
    assert deep_ep.Buffer.is_sm90_compiled() == (torch.cuda.is_available()
                                                 and torch.cuda.get_device_capability() >= (9, 0))
    assert (deep_ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
            == ep.Buffer.get_ep_buffer_size_hint(128, 7168, 8, 256))
    # Past the bounds, named by DeepEP's method (the runtime's name was one the caller never called)
    with pytest.raises(ValueError, match=r"^get_low_latency_rdma_size_hint: num_ranks must be <= 64, got 65$"):
        deep_ep.Buffer.get_low_latency_rdma_size_hint(8, 128, 65, 260)
    previous = deep_ep.Buffer.num_sms
    try:
        deep_ep.Buffer.set_num_sms(24)
        assert deep_ep.Buffer.num_sms == 24
    finally:
        deep_ep.Buffer.num_sms = previous


def test_enable_shrink_masks_after_deepeps_timeout_and_config_has_deepeps_defaults():
    """DeepEP's kernels mask a silent peer after ~100 s with enable_shrink (and trap after as long
    without it, which a mask here would turn into results silently short: forever instead)."""
    case = make_case(17, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    group = ep.LocalGroup(1).rank_group(0)
    settings = ({}, dict(enable_shrink=True), dict(enable_shrink=True, timeout_us=5), dict(timeout_us=7))
    timeouts = [new_buffer(group, case, **kwargs).timeout_us for kwargs in settings]
    assert timeouts == [-1, 100_000_000, 5, 7]
    config = deep_ep.Config()
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 256)


def test_a_torch_process_group_builds_the_buffers():
    """DeepEP's and Mooncake EP's Buffers take a torch ProcessGroup: so do both of mooncake_ep's."""
    dist = pytest.importorskip("torch.distributed")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        process_group = dist.group.WORLD
        plain = ep.Buffer(process_group, 1 << 20, backend="reference")
        assert type(plain.group).__name__ == "TorchGroup" and plain.group_size == plain.num_ranks == 1
        compatible = deep_ep.Buffer(process_group, 0, 1 << 20, low_latency_mode=True, backend="reference")
        assert compatible.group_size == 1 and compatible.rank == 0
    finally:
        dist.destroy_process_group()


def test_async_finish_adds_recv_stats_on_the_communication_stream(monkeypatch):
    """With async_finish the stats add joins the dispatch on the communication stream, and the returned
    event follows it; no stream is made for it. A stream of its own, waiting there for this rank's
    receive, could share a hardware queue with an in-process peer's stream and hold back the peer's
    dispatch that the receive waits for (an H100 run masked a healthy peer so). CUDA stand-ins: the
    order of the calls is what is checked."""
    log = []

    Stream, Event = logged_stream_and_event(log)
    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(("enter", self.stream.name))

        def __exit__(self, *exc_info):
            log.append(("exit", self.stream.name))

    class Tensor:
        is_cuda = True
        device = torch.device("cuda", 0)

        def __init__(self, name):
            self.name = name

        def is_inference(self):
            return False

        def add_(self, other):
            log.append(("add", self.name, other.name))

        def record_stream(self, stream):
            log.append(("record_stream", self.name, stream.name))

    def no_new_stream(*args, **kwargs):
        raise AssertionError("a stream was made for the stats add")

    comm, caller = Stream("comm"), Stream("caller")
    monkeypatch.setattr(torch.cuda, "Stream", no_new_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    runtime_event = deep_ep.EventOverlap(lambda: log.append(("runtime event wait",)), extra="kept")
    buffer = deep_ep.Buffer.__new__(deep_ep.Buffer)  # only what _add_recv_count reads
    buffer._comm_stream = None
    buffer.get_comm_stream = lambda: comm

    event, hook = buffer._add_recv_count(Tensor("stats"), Tensor("recv_count"), runtime_event, None, async_finish=True)
    assert hook is None and event.extra == "kept"
    done = log[2][2]
    assert log == [("enter", "comm"), ("add", "stats", "recv_count"), ("record", "comm", done), ("exit", "comm"),
                   ("record_stream", "stats", "comm")]
    event.current_stream_wait()
    assert log[-1] == ("wait", "caller", done)
    buffer._add_recv_count(Tensor("stats"), Tensor("recv_count"), runtime_event, None, async_finish=True)
    assert buffer._comm_stream is comm  # made once, then reused


def test_deepeps_event_overlap_api():
    """What engines read of DeepEP's EventOverlap: ``event`` (None without async_finish, as
    TensorRT-LLM asserts; set to None to let go of it), ``extra_tensors``,
    ``current_stream_wait(release_handle)``, ``wait()``, ``register_hook_after_wait``, ``with
    event(release_handle=True):``, and DeepEP's constructor ``EventOverlap(event, extra_tensors=)``."""
    log = []
    event = deep_ep.EventOverlap(lambda: log.append("wait"), extra=("kept",))
    assert event.extra_tensors == ("kept",) and event.event is not None and event.event is event.event
    event.event.current_stream_wait()
    assert log == ["wait"]

    def hook():
        log.append("hook")
        if log.count("hook") == 1:
            raise ValueError("the hook's first run fails")
        return "result"

    event.register_hook_after_wait(hook)
    with pytest.raises(RuntimeError, match="a hook is already registered on this EventOverlap"):
        event.register_hook_after_wait(lambda: None)
    with pytest.raises(ValueError, match="the hook's first run fails"):
        event.wait()
    assert event.wait() == "result" and log == ["wait", "wait", "hook", "wait", "hook"]  # kept until it returned
    assert event.current_stream_wait() is None and log[-1] == "wait"  # then run no more
    with event(release_handle=True):
        log.append("body")
    assert log[-2:] == ["body", "wait"] and event.event is None and event.extra_tensors == ("kept",)
    event.register_hook_after_wait(lambda: log.append("late hook"))
    with event:  # released: nothing to wait for, and nothing runs on exit (as DeepEP's)
        pass
    assert log[-1] == "wait" and len(log) == 8

    inner_event = deep_ep.EventOverlap(lambda: log.append("inner")).event
    rewrapped = deep_ep.EventOverlap(inner_event, extra_tensors=(1,))
    assert rewrapped.event is inner_event  # an EventHandle is kept as given, as DeepEP's `self.event = event`
    rewrapped.current_stream_wait()
    assert log[-1] == "inner" and rewrapped.extra_tensors == (1,)
    assert deep_ep.EventOverlap(event=None).event is None
    rewrapped.event = None  # DeepEP's callers let go of the event so
    rewrapped.current_stream_wait()
    assert log[-1] == "inner" and len(log) == 9
    with pytest.raises(TypeError, match=r"EventOverlap: event must have current_stream_wait\(\) \(or be the wait, "
                                        r"a callable\), got int"):
        deep_ep.EventOverlap(event=3)
    # DeepEP's two plain attributes, which callers set: the hook (as its deterministic dispatch does), and
    # the tensors (None lets go of them).
    rewrapped.hook_after_wait = lambda: "set as an attribute"
    assert rewrapped.current_stream_wait() == "set as an attribute" and rewrapped.hook_after_wait is None
    rewrapped.extra_tensors = None
    assert rewrapped.extra_tensors is None and rewrapped.extra is None

    case = make_case(19, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    buffer = new_buffer(ep.LocalGroup(1).rank_group(0), case)
    x, topk_idx = to_torch(case.xs[0]), to_torch(case.topk_idxs[0])
    _, _, _, sync_event, _ = buffer.low_latency_dispatch(x, topk_idx, case.num_max_tokens, case.num_experts,
                                                         use_fp8=False)
    assert sync_event.event is None  # the work is on the caller's stream


def test_capture_records_an_event_on_torchs_current_stream(monkeypatch):
    """DeepEP's ``Buffer.capture()``, a static helper of any mode: an event recorded on torch's
    current stream, which a later current stream waits for. CUDA stand-ins."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^deep_ep.Buffer.capture: records an event on torch's current CUDA "
                                           r"stream; no CUDA device is available"):
        deep_ep.Buffer.capture()
    log = []

    Stream, Event = logged_stream_and_event(log)
    streams = iter([Stream("recording"), Stream("waiting")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: next(streams))
    event = deep_ep.Buffer.capture()
    recorded = log[0][2]
    assert log == [("record", "recording", recorded)] and event.event is not None
    event.current_stream_wait()
    assert log[-1] == ("wait", "waiting", recorded)


def test_the_group_given_is_kept_and_comm_stands_in_for_it():
    """DeepEP's ``buffer.group`` is the group given: engines rebuild a cached Buffer when
    ``_buffer.group != group`` (DeepEP's own get_buffer recipe), which a wrapper would make every
    call. ``comm`` is used where ``group`` is None, and the positional order is DeepEP 2.x's."""
    case = make_case(23, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    group = ep.LocalGroup(1).rank_group(0)
    assert new_buffer(group, case).group is group

    class Communicator:  # mpi4py's, as MPIGroup uses it: one rank
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1

        def allgather(self, obj):
            return [obj]

        def Barrier(self):
            pass

    comm = Communicator()
    from_comm = new_buffer(None, case, comm=comm)
    assert from_comm.group is comm and from_comm.group_size == 1 and from_comm.runtime.num_ranks == 1
    with pytest.raises(TypeError, match=r"^deep_ep.Buffer: comm must be an mpi4py communicator, got int$"):
        new_buffer(None, case, comm=42)
    # DeepEP 1.x's ten positional arguments (use_fabric eighth): enable_shrink lands in comm.
    with pytest.raises(TypeError, match=r"^deep_ep.Buffer: comm got a bool: DeepEP 1.x had use_fabric eighth"):
        deep_ep.Buffer(group, 0, case.size_hint, True, 2, True, False, False, False, True, backend="reference")
    # (group, nvl, rdma, low_latency_mode, qps, allow_nvlink, allow_mnnvl, explicitly_destroy, enable_shrink)
    positional = deep_ep.Buffer(group, 0, case.size_hint, True, 2, True, False, True, True, backend="reference")
    assert positional.explicitly_destroy and positional.enable_shrink and positional.timeout_us == 100_000_000
    assert not new_buffer(group, case, use_fabric=True).enable_shrink  # DeepEP 1.x's flag, by name


def test_bf16_dispatch_ignores_the_fp8_flags_as_deepeps():
    """Engines pass ``round_scale`` and ``use_ue8m0`` whatever ``use_fp8`` is (SGLang's dispatchers
    on Blackwell did); DeepEP's bf16 dispatch ignores them."""
    case = make_case(29, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    buffer = new_buffer(ep.LocalGroup(1).rank_group(0), case)
    x, topk_idx = to_torch(case.xs[0]), to_torch(case.topk_idxs[0])
    T, E = case.num_max_tokens, case.num_experts
    plain, plain_count, _, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    flagged, flagged_count, _, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, round_scale=True,
                                                                  use_ue8m0=True)
    assert flagged.dtype == torch.bfloat16
    torch.testing.assert_close(flagged_count, plain_count, rtol=0, atol=0)
    for e in range(plain.shape[0]):  # the received rows (the rest is the workspace's)
        rows = int(plain_count[e])
        assert torch.equal(flagged[e, :rows].view(torch.int16), plain[e, :rows].view(torch.int16))


def test_flags_are_taken_as_deepeps_bool_caster_takes_them():
    """DeepEP's flags go through pybind11's bool caster, which takes 0 / 1 (an engine's config) and numpy's
    bools; a tensor (DeepEP's older orders put one there), None or a float is still refused by name."""
    case = make_case(31, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    buffer = new_buffer(ep.LocalGroup(1).rank_group(0), case, enable_shrink=np.bool_(True), explicitly_destroy=1)
    assert buffer.explicitly_destroy is True and buffer.enable_shrink is True
    x, topk_idx, topk_weights = (to_torch(a[0]) for a in (case.xs, case.topk_idxs, case.weights))
    T, E = case.num_max_tokens, case.num_experts
    plain = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True, round_scale=True, use_ue8m0=False)
    loose, _, handle, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, T, E, use_fp8=np.bool_(True), round_scale=1, use_ue8m0=np.int64(0), async_finish=0,
        return_recv_hook=np.bool_(False))
    assert event.event is None and hook is None
    for e, count in enumerate(plain[1].tolist()):
        assert torch.equal(loose[0][e, :count].view(torch.uint8), plain[0][0][e, :count].view(torch.uint8))
        assert torch.equal(loose[1][e, :count], plain[0][1][e, :count])
    combined, _, hook = buffer.low_latency_combine(to_torch(expert_outputs(case, 3)[0]), topk_idx, topk_weights,
                                                   handle, use_logfmt=0, zero_copy=np.bool_(False),
                                                   return_recv_hook=1)
    hook()
    assert combined.shape == (case.num_max_tokens, case.hidden)
    buffer.low_latency_update_mask_buffer(np.int64(0), mask=1)
    assert buffer.active_ranks.tolist() == [0]
    buffer.low_latency_update_mask_buffer(0, mask=np.bool_(False))
    assert buffer.active_ranks.tolist() == [1]
    with pytest.raises(TypeError, match=r"^low_latency_combine: return_recv_hook must be a bool, got float$"):
        buffer.low_latency_combine(to_torch(expert_outputs(case, 3)[0]), topk_idx, topk_weights, handle,
                                   return_recv_hook=1.0)
    buffer.destroy()


@pytest.mark.parametrize("explicitly_destroy", [False, True])
def test_dropping_a_buffer_destroys_it_as_deepeps_destructor_does(monkeypatch, explicitly_destroy):
    """DeepEP's destructor destroys a Buffer built with explicitly_destroy=False (its default), and
    TensorRT-LLM grows its buffer with `del buffer` before building the next; ours left the workspace
    to the garbage collector, which frees it without waiting for the peers (helper-147). Dropped on
    another thread than the one that built it, nothing collective runs there (the peers could not
    come): the runtime's finalizer is left to it, as before."""
    case = make_case(17, num_ranks=2, num_max_tokens=4, hidden=128, num_experts=2, num_topk=1)
    destroyed = []
    real_destroy = ep.Buffer.destroy
    monkeypatch.setattr(ep.Buffer, "destroy", lambda self: (destroyed.append(self.rank), real_destroy(self))[1])

    def drop_here(group):
        buffer = new_buffer(group, case, explicitly_destroy=explicitly_destroy)
        del buffer
        return sorted(destroyed)

    dropped_on_rank_threads = ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(drop_here)
    assert sorted(destroyed) == ([] if explicitly_destroy else [0, 1])
    destroyed.clear()
    kept = ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(lambda group: new_buffer(group, case))
    del kept[:]  # on this thread, not the ranks' own
    assert destroyed == []
    assert len(dropped_on_rank_threads) == 2


def test_a_buffer_whose_construction_failed_drops_without_a_word(monkeypatch):
    """__del__ runs on a half-built Buffer too, failed before its runtime or after it (helper-150: an
    AttributeError there): it must do nothing."""
    import gc
    import sys

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    group = ep.LocalGroup(1).rank_group(0)
    with pytest.raises(ValueError, match="low_latency_mode must be True"):
        deep_ep.Buffer(group, 0, 1 << 20, low_latency_mode=False)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (stand-in)")

    with monkeypatch.context() as patch:
        patch.setattr(deep_ep.torch, "ones", out_of_memory)  # after the runtime is built
        with pytest.raises(RuntimeError, match="stand-in"):
            deep_ep.Buffer(group, 0, 1 << 22, low_latency_mode=True, backend="reference")
    gc.collect()
    assert [u.exc_value for u in unraisable] == []


def test_a_buffer_freed_by_the_garbage_collector_is_not_destroyed_there(monkeypatch):
    """A collection runs at whatever allocation, perhaps inside another collective of the group, whose
    lock it holds: a collective destroy there deadlocked (helper-150). Left to the runtime's finalizer."""
    import gc

    case = make_case(29, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=1)
    destroyed = []
    real_destroy = ep.Buffer.destroy
    monkeypatch.setattr(ep.Buffer, "destroy", lambda self: (destroyed.append(self.rank), real_destroy(self))[1])
    buffer = new_buffer(ep.LocalGroup(1).rank_group(0), case)
    buffer.cycle = buffer  # only the collector frees it
    del buffer
    gc.collect()
    assert destroyed == []


def test_the_runtimes_refusals_of_every_kind_are_named_by_deepeps_methods():
    """Only TypeError and ValueError were renamed: a pending hook, a destroyed Buffer or ranks in different
    calls named `dispatch` / `combine` (on deep_ep.Buffer, the high-throughput stubs), and the advice named
    mooncake_ep's methods (helper-147, helper-148)."""
    case = make_case(19, num_ranks=1, num_max_tokens=4, hidden=128, num_experts=2, num_topk=2)
    buffer = new_buffer(ep.LocalGroup(1).rank_group(0), case)
    x, topk_idx, topk_weights = (to_torch(a[0]) for a in (case.xs, case.topk_idxs, case.weights))
    T, E = case.num_max_tokens, case.num_experts
    first = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, return_recv_hook=True)
    with pytest.raises(RuntimeError, match=r"^low_latency_combine: the dispatch of this handle has not received"):
        buffer.low_latency_combine(first[0], topk_idx, topk_weights, first[2])
    with pytest.raises(RuntimeError, match=r"^get_next_low_latency_combine_buffer: the dispatch of this handle has "
                                           r"not received"):
        buffer.get_next_low_latency_combine_buffer(first[2])
    second = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False, return_recv_hook=True)
    with pytest.raises(RuntimeError, match=r"^low_latency_dispatch: the dispatch two calls ago still waits"):
        buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
    first[4](), second[4]()
    with pytest.raises(TypeError, match=r"^low_latency_combine: handle must be the handle returned by "
                                        r"low_latency_dispatch, got tuple"):
        buffer.low_latency_combine(second[0], topk_idx, topk_weights, (None, None, T, case.hidden, E))
    with pytest.raises(ValueError, match=r"^low_latency_combine: zero_copy=True reads the expert outputs from "
                                         r"get_next_low_latency_combine_buffer\(handle\)"):
        buffer.low_latency_combine(second[0], topk_idx, topk_weights, second[2], zero_copy=True)
    with pytest.raises(TypeError, match=r"^low_latency_combine: zero_copy must be a bool, got torch.Tensor"):
        buffer.low_latency_combine(second[0], topk_idx, topk_weights, second[2], zero_copy=topk_weights)
    combined, _, _ = buffer.low_latency_combine(second[0], topk_idx, topk_weights, second[2])  # still works
    assert combined.shape == x.shape
    buffer.destroy()
    with pytest.raises(RuntimeError, match=r"^low_latency_dispatch: this Buffer was destroyed"):
        buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)


def test_ranks_in_different_calls_are_named_by_deepeps_method():
    case = make_case(23, num_ranks=2, num_max_tokens=4, hidden=128, num_experts=2, num_topk=1)

    def rank_fn(group):
        buffer = new_buffer(group, case)
        x, topk_idx = (to_torch(a[group.rank]) for a in (case.xs, case.topk_idxs))
        with pytest.raises(RankMismatchError, match=r"^low_latency_dispatch: "):
            buffer.low_latency_dispatch(x, topk_idx, case.num_max_tokens - group.rank, case.num_experts,
                                        use_fp8=False)

    ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
