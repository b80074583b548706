"""DeepEP's low-latency API on :class:`mooncake_ep.Buffer`: an engine written for ``deep_ep`` switches
with one line, ``import mooncake_ep.deep_ep as deep_ep``.

:class:`Buffer` takes DeepEP's constructor arguments, and its ``low_latency_*`` methods take DeepEP's
arguments in DeepEP's order (its current one: ``cumulative_local_expert_recv_stats`` fifth in
dispatch, ``use_logfmt`` fifth in combine) and return what DeepEP's return. torch tensors, as DeepEP::

    import mooncake_ep.deep_ep as deep_ep

    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(process_group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, T, num_experts)
    combined_x, event, hook = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)

What differs from DeepEP:
    - Only the low-latency mode: ``low_latency_mode=True`` is required, and the high-throughput
      methods (``dispatch``, ``combine``, ``get_dispatch_layout``, ``Buffer.get_dispatch_config``...)
      and :class:`Config`'s size hints raise NotImplementedError. ``Buffer.capture()`` works (an
      event on torch's current stream).
    - The handle is a :class:`mooncake_ep.Handle`, not a tuple of tensors; callers pass it on as
      they do DeepEP's. ``Buffer.group`` is the group given (``comm`` where ``group`` is None), as
      DeepEP's, so an engine's check that a cached Buffer is still its group's holds.
    - The kernels measure no wait times: ``dispatch_wait_recv_cost_stats`` and
      ``combine_wait_recv_cost_stats`` are refused, and so is ``use_logfmt`` (a LogFMT combine is
      not built). A dispatch in DeepEP's older orders (``use_fp8`` fifth, or sixth) is refused, and
      so is a combine with ``zero_copy=True`` fifth; a combine's other flags after ``handle`` go by
      name.
    - A rank that stops is masked after ``timeout_us`` (a keyword of the constructor). By default
      that is DeepEP's 100 s with ``enable_shrink=True``, where DeepEP's kernels mask it after that
      long too, and forever without, where DeepEP's give up after 100 s and trap (which leaves the
      CUDA context unusable; a mask nobody reads would leave results silently short). The masks
      are DeepEP's mask buffer (``low_latency_update_mask_buffer`` and the like) and
      :attr:`Buffer.active_ranks`.
    - :class:`EventOverlap` has DeepEP's API (``event``, None without ``async_finish``;
      ``extra_tensors``; ``current_stream_wait(release_handle)``, ``wait()``,
      ``register_hook_after_wait``, ``with event(release_handle=True):``, and its constructor),
      except that ``current_stream_wait()`` of an event that is None waits for nothing (a hook
      registered with ``register_hook_after_wait`` still runs) instead of
      failing an assert.
    - The constructor's positional order is DeepEP 2.x's (``explicitly_destroy`` eighth); DeepEP
      1.x's ``use_fabric`` goes by name. A 1.x call with ten positional arguments is refused (a bool
      lands in ``comm``); one with nine (up to ``explicitly_destroy``) cannot be told apart and
      sets ``enable_shrink`` instead.
    - ``Buffer.group`` is the caller's group; the mooncake_ep group is ``Buffer.runtime.group``.
    - A bf16 dispatch (``use_fp8=False``) ignores ``round_scale`` and ``use_ue8m0``, as DeepEP's does
      (``use_ue8m0`` still needs ``round_scale``).
    - ``get_next_low_latency_combine_buffer(handle)`` wants the dispatch received (its hook called):
      peers may read the buffer's previous contents until then.
    - :meth:`Buffer.destroy` frees the workspace whether ``explicitly_destroy`` was given or not.
      Dropping a Buffer built without it destroys it, as DeepEP's destructor does, but only on the
      thread that built it and not in a garbage collection (see ``Buffer.__del__``).
    - A handle is good for a combine until two more dispatches of the Buffer were made, as
      :class:`mooncake_ep.Handle` (its routing lives in the workspace half of its dispatch);
      DeepEP's handle holds tensors of its own. Two micro-batches in flight (vLLM's and SGLang's
      two-batch overlap) fit; a third is refused by name, never combined on another's routing.
      A handle combined through the workspace (``zero_copy=True``, ``return_recv_hook=True``, or
      any combine with ranks in other processes, whose peers read copies there) takes no second
      combine (RuntimeError, "dispatch again"): the peers may still read the first's rows. DeepEP's
      own ``tests/test_low_latency.py`` combines each dispatch twice, so it fails there across
      processes, and in one process in its hook mode.
    - :meth:`Buffer.clean_low_latency_buffer` cleans nothing and waits for no peer: it is neither a
      barrier nor, with ``enable_shrink``, the point where a dead rank is masked (DeepEP's kernel is
      both); the next dispatch or combine masks it.
    - Flags (``use_fp8``, ``async_finish``, ``mask``...) take what DeepEP's pybind11 caster takes
      but None: bools, numpy's bools and integers.
    - An fp8 block holding inf with ``round_scale``: both store an inf scale, but here its other
      values quantise as times 0 (the reference's ``1 / scale``), where DeepEP's ``2^-exponent`` wraps
      to -inf and flips their signs. Neither dequantises to anything; without ``round_scale``, and for
      NaN, zero and denormal blocks, the bytes are DeepEP's.
    - ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl`` and ``use_fabric``
      are checked and choose nothing (``allow_nvlink_for_low_latency_mode=False`` included): the
      transport is picked from where the ranks are (peer memory on one host).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mooncake_ep import _constants, layout
from mooncake_ep._handshake import RankMismatchError
from mooncake_ep.buffer import Buffer as _Buffer
from mooncake_ep.buffer import EventOverlap, Handle
from mooncake_ep.group import is_communicator
from mooncake_ep.validation import check_experts, check_int, check_timeout, type_name

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

logger = logging.getLogger("mooncake_ep")

# Whether a garbage collection is running (gc.callbacks): a Buffer it frees is not destroyed there.
_collecting_garbage = [False]


def _note_collection(phase: str, info: dict) -> None:
    _collecting_garbage[0] = phase == "start"


gc.callbacks.append(_note_collection)

topk_idx_t = torch.int64  # DeepEP's dtype of topk_idx (int32 is taken too)

# How long DeepEP's kernels wait for a peer (NUM_TIMEOUT_CYCLES, 200G cycles, "~= 100s") before
# masking it with enable_shrink: the timeout_us a Buffer built with enable_shrink gets by default.
SHRINK_TIMEOUT_US = 100_000_000

# DeepEP's high-throughput methods (static ones included, called on the class): each raises
# NotImplementedError when called, so a call says what is missing and hasattr() finds them as in DeepEP.
_HIGH_THROUGHPUT_METHODS = ("get_dispatch_config", "get_combine_config", "get_dispatch_layout", "dispatch",
                            "combine", "internode_dispatch", "internode_combine", "intranode_dispatch",
                            "intranode_combine", "get_local_buffer_tensor")


def _high_throughput(name: str) -> NotImplementedError:
    return NotImplementedError(f"deep_ep.{name}: DeepEP's high-throughput mode is not built in mooncake_ep; only its "
                               f"low-latency methods are (low_latency_dispatch, low_latency_combine, ...)")


class Config:
    """DeepEP's tuning of its high-throughput kernels, which mooncake_ep has not: held, so that an
    engine that imports or builds one still loads; its buffer size hints raise NotImplementedError."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:  # DeepEP's defaults
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise _high_throughput("Config.get_nvl_buffer_size_hint")

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        raise _high_throughput("Config.get_rdma_buffer_size_hint")


class Buffer:
    """DeepEP's ``deep_ep.Buffer`` in low-latency mode, over a :class:`mooncake_ep.Buffer` (:attr:`runtime`).

    Args:
        group: a torch ``ProcessGroup`` (as DeepEP), an mpi4py communicator, or a mooncake_ep group;
            None to take ``comm``.
        num_nvl_bytes: DeepEP's high-throughput buffer; unused (that mode is not built).
        num_rdma_bytes: the low-latency workspace's bytes, at least
            :meth:`get_low_latency_rdma_size_hint` for every configuration used.
        low_latency_mode: must be True.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: DeepEP's transport
            settings, accepted and unused: the transport is chosen from where the ranks are (one
            process or one host; several hosts are refused until the proxy transport exists).
            ``use_fabric`` (DeepEP 1.x's, eighth there) goes by name: the positional order is DeepEP 2.x's.
        explicitly_destroy: False (DeepEP's default): dropping the Buffer destroys it, as DeepEP's
            destructor does (see ``__del__``); True: only :meth:`destroy` does, which works either way.
        enable_shrink: DeepEP's fault tolerance: peers that stop are masked (after ``timeout_us``)
            instead of the kernels trapping. Here the default of ``timeout_us`` follows it, and the
            mask buffer's methods need it, as DeepEP's do.
        comm: an mpi4py communicator, used where ``group`` is None (as DeepEP's).
        timeout_us: microseconds a kernel waits for a peer before masking it; -1 waits forever.
            None (the default): DeepEP's 100 s with ``enable_shrink``, else forever.
        num_sms, backend, kernel_cache_dir: as :class:`mooncake_ep.Buffer`'s.

    Attributes:
        rank, group_size, group: this rank, the number of ranks, and the group given (or ``comm``).
        explicitly_destroy, enable_shrink: as given.
        runtime: the :class:`mooncake_ep.Buffer`.
        active_ranks: ``[group_size]`` int32 on the Buffer's device, 1 = alive, 0 = masked (by the
            kernels after ``timeout_us``, or by :meth:`low_latency_update_mask_buffer`).
    """

    num_sms: int = 20  # DeepEP's SMs of its high-throughput kernels (set_num_sms); not the low-latency ones

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None, *, use_fabric: bool = False, timeout_us: int | None = None,
                 num_sms: int | None = None, backend: str = "auto", kernel_cache_dir: str | None = None) -> None:
        where = "deep_ep.Buffer"
        low_latency_mode = _flag(where, "low_latency_mode", low_latency_mode)
        if low_latency_mode is not True:
            raise ValueError(f"{where}: low_latency_mode must be True: mooncake_ep builds DeepEP's low-latency mode "
                             f"only (its high-throughput dispatch and combine are not there), got {low_latency_mode!r}")
        check_int(where, "num_nvl_bytes", num_nvl_bytes, minimum=0)
        # Under DeepEP's name: its default 0 is a likely first call, and the runtime names its own argument.
        check_int(where, "num_rdma_bytes", num_rdma_bytes, minimum=layout.header_bytes())
        check_int(where, "num_qps_per_rank", num_qps_per_rank, minimum=1)
        _flag(where, "allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode)
        _flag(where, "allow_mnnvl", allow_mnnvl)
        _flag(where, "use_fabric", use_fabric)
        explicitly_destroy = _flag(where, "explicitly_destroy", explicitly_destroy)
        enable_shrink = _flag(where, "enable_shrink", enable_shrink)
        if isinstance(comm, bool):  # DeepEP 1.x's order, positionally: enable_shrink landed here
            raise TypeError(f"{where}: comm got a bool: DeepEP 1.x had use_fabric eighth, where 2.x's order (taken "
                            f"here) has explicitly_destroy; pass explicitly_destroy, enable_shrink and use_fabric by "
                            f"name")
        if group is None:  # DeepEP's: comm is "the communicator to use in case the group parameter is absent"
            if comm is None:
                raise ValueError(f"{where}: group or comm must be given (a torch ProcessGroup, an mpi4py "
                                 f"communicator or a mooncake_ep group)")
            if not is_communicator(comm):
                raise TypeError(f"{where}: comm must be an mpi4py communicator, got {type(comm).__name__}")
            group = comm
        if timeout_us is None:
            timeout_us = SHRINK_TIMEOUT_US if enable_shrink else _constants.TIMEOUT_FOREVER
        # Every argument is checked before the Buffer's collective construction: a rank refused after it
        # would leave its peers a Buffer whose partner has none (and its own undestroyed).
        timeout_us = check_timeout(where, timeout_us)
        self.runtime = _Buffer(group, num_rdma_bytes, num_sms=num_sms, backend=backend,
                               kernel_cache_dir=kernel_cache_dir)
        self.timeout_us = timeout_us
        self.group = group  # the caller's, as DeepEP's: engines compare it to decide to build anew
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.rank = self.runtime.rank
        self.group_size = self.runtime.num_ranks
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = self.runtime.num_ep_buffer_bytes
        self.low_latency_mode = True
        device = "cpu" if self.runtime.backend == "reference" else torch.device("cuda", self.runtime.device_id)
        self.active_ranks = torch.ones(self.group_size, dtype=torch.int32, device=device)
        self._comm_stream: torch.cuda.Stream | None = None  # get_comm_stream's, for async_finish's recv-stats adds
        # Where dropping it may destroy it (__del__): the thread itself, not its ident, which a later
        # thread may be given once this one ends.
        self._built_on_thread = weakref.ref(threading.current_thread())

    def __del__(self) -> None:
        """DeepEP's destructor: a Buffer built with ``explicitly_destroy=False`` (DeepEP's default) is
        destroyed when dropped, a collective as :meth:`destroy` is, so every rank drops its Buffer at
        the same point. Engines rely on it: TensorRT-LLM grows its buffer with ``del buffer`` before
        building the next, where a freed workspace that a slower peer still used would be written
        into. Only when its last reference is dropped, on the thread that built it, outside
        interpreter shutdown: a Buffer freed by the garbage collector (in a reference cycle, at
        whatever allocation, perhaps inside another collective of the group) or on another thread (an
        in-process rank's Buffer handed on) would wait there for peers that cannot come, and the
        runtime's finalizer releases it instead, as any dropped :class:`mooncake_ep.Buffer`."""
        runtime = self.__dict__.get("runtime")  # absent: the constructor failed before building it
        built_on = self.__dict__.get("_built_on_thread")  # absent: it failed after building it
        if (runtime is None or built_on is None or self.explicitly_destroy or sys.is_finalizing()
                or _collecting_garbage[0] or built_on() is not threading.current_thread()):
            return
        try:
            runtime.destroy()
        except Exception as exc:  # noqa: BLE001 - a destructor may not raise; destroy() would have
            logger.warning("mooncake_ep: deep_ep.Buffer of rank %d dropped, its destroy() failed: %s", self.rank, exc)

    def __repr__(self) -> str:
        return f"deep_ep.Buffer(rank={self.rank}, group_size={self.group_size}, runtime={self.runtime!r})"

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the kernels have SM90 code: they are compiled at run time for the GPU in use, so
        wherever the current CUDA device is an SM90 (or newer) one."""
        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on torch's current stream, as DeepEP's: its ``current_stream_wait()``
        makes the stream current at that later time wait for the work queued before the capture."""
        if not torch.cuda.is_available():
            raise RuntimeError("deep_ep.Buffer.capture: records an event on torch's current CUDA stream; no CUDA "
                               "device is available")
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream())
        return EventOverlap(lambda: torch.cuda.current_stream().wait_event(done))

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The communication stream ``async_finish`` calls run on, as a torch stream."""
        if self.runtime.comm_stream_ptr is None:
            raise RuntimeError("get_comm_stream: this Buffer runs on the reference backend, which has no stream")
        return torch.cuda.ExternalStream(self.runtime.comm_stream_ptr, device=self.active_ranks.device)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SMs of its high-throughput kernels, which mooncake_ep has not: recorded, as DeepEP
        does, and used by nothing. The low-latency kernels' SMs are the constructor's ``num_sms``."""
        check_int("deep_ep.Buffer.set_num_sms", "new_num_sms", new_num_sms, minimum=2)
        if new_num_sms % 2:
            raise ValueError(f"deep_ep.Buffer.set_num_sms: new_num_sms must be even (as DeepEP's), got {new_num_sms}")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` that a configuration needs
        (:meth:`mooncake_ep.Buffer.get_ep_buffer_size_hint`)."""
        try:
            return _Buffer.get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
        except _RENAMED_ERRORS as exc:
            raise _named_as_deepeps(exc, "get_ep_buffer_size_hint", "get_low_latency_rdma_size_hint") from exc.__cause__

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """DeepEP zeroes its signals here before first use; mooncake_ep's carry the step they belong
        to (stale ones are told apart), so nothing is cleaned. The configuration is checked: a
        workspace too small for it raises ValueError now rather than at the first dispatch. Local:
        unlike DeepEP's clean kernel, no barrier with the peers, and so no rank masked here
        (``enable_shrink``); the next dispatch or combine masks a rank that stopped."""
        needed = self.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size,
                                                     num_experts)
        if needed > self.num_rdma_bytes:
            raise ValueError(f"clean_low_latency_buffer: num_rdma_bytes={self.num_rdma_bytes} is smaller than the "
                             f"{needed} bytes of T={num_max_dispatch_tokens_per_rank}, hidden={hidden}, "
                             f"num_experts={num_experts} (get_low_latency_rdma_size_hint)")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each token to the ranks of its top-k experts; receive this rank's experts' tokens.

        Args:
            x: ``[num_tokens, hidden]`` bf16, num_tokens <= num_max_dispatch_tokens_per_rank.
            topk_idx: ``[num_tokens, num_topk]`` int64 global expert ids, -1 = none.
            num_max_dispatch_tokens_per_rank: T, equal on every rank.
            num_experts: E, a multiple of group_size.
            cumulative_local_expert_recv_stats: ``[E / group_size]`` int32, or None: recv_count is
                added to it, ordered as the receive (in the hook's stream order with
                return_recv_hook; before the event completes with async_finish).
            dispatch_wait_recv_cost_stats: must be None (not measured).
            use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook: as DeepEP's, see
                :meth:`mooncake_ep.Buffer.dispatch`; with use_fp8=False, round_scale and use_ue8m0
                are ignored, as DeepEP's (use_ue8m0 still needs round_scale).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)`` as DeepEP's: recv_x
            ``[E_l, group_size * T, hidden]`` bf16, or ``(e4m3 data, fp32 scales [E_l, group_size * T,
            hidden / 128])`` with use_fp8 (int32 ``ceil(hidden / 512)`` columns with use_ue8m0);
            recv_count ``[E_l]`` int32.
        """
        where = "low_latency_dispatch"
        _check_tensor(where, "x", x)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:  # first: a bool here is the oldest order's use_fp8 (fifth), whatever follows
            _check_recv_stats(where, stats, x, num_experts, self.group_size)
        if isinstance(dispatch_wait_recv_cost_stats, bool):
            raise TypeError(f"{where}: dispatch_wait_recv_cost_stats got a bool (DeepEP's older API had use_fp8 "
                            f"sixth, after cumulative_local_expert_recv_stats: pass it by name)")
        _check_unmeasured(where, "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats)
        use_fp8, round_scale, use_ue8m0 = (_flag(where, "use_fp8", use_fp8), _flag(where, "round_scale", round_scale),
                                           _flag(where, "use_ue8m0", use_ue8m0))
        async_finish = _flag(where, "async_finish", async_finish)
        return_recv_hook = _flag(where, "return_recv_hook", return_recv_hook)
        # DeepEP's bf16 dispatch ignores both but for one check, made by its kernel launcher (internode_ll.cu,
        # "FP8 checks") whatever use_fp8 is, though its C++ entry makes it in the fp8 branch only.
        if not use_fp8:
            if use_ue8m0 and not round_scale:
                raise ValueError(f"{where}: use_ue8m0=True needs round_scale=True (as DeepEP's)")
            round_scale = use_ue8m0 = False
        try:
            recv_x, recv_count, handle, event, hook = self.runtime.dispatch(
                x, topk_idx, self.active_ranks, num_max_dispatch_tokens_per_rank, num_experts, self.timeout_us,
                use_fp8, async_finish, return_recv_hook, round_scale=round_scale, use_ue8m0=use_ue8m0)
        except _RENAMED_ERRORS as exc:
            raise _named_as_deepeps(exc, "dispatch", where) from exc.__cause__
        if stats is not None:
            event, hook = self._add_recv_count(stats, recv_count, event, hook, async_finish)
        return recv_x, recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Handle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: torch.Tensor | None = None, combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """Bring the expert outputs back to their tokens' ranks, weighted and summed.

        Args:
            x: ``[E_l, group_size * T, hidden]`` bf16 expert outputs laid out as recv_x (ignored with
                zero_copy, which reads :meth:`get_next_low_latency_combine_buffer`).
            topk_idx, topk_weights: ``[num_tokens, num_topk]``: the dispatch's ids, and fp32 weights.
            handle: the dispatch's.
            use_logfmt: must be False (not built).
            zero_copy, async_finish, return_recv_hook, out: as DeepEP's, see :meth:`mooncake_ep.Buffer.combine`.
            combine_wait_recv_cost_stats: must be None (not measured).

        Returns:
            ``(combined_x [num_tokens, hidden] bf16, event, hook)``.
        """
        where = "low_latency_combine"
        if _flag(where, "use_logfmt", use_logfmt):
            raise NotImplementedError(f"{where}: use_logfmt=True (DeepEP's LogFMT-compressed combine) is not built; "
                                      f"bf16 is sent (DeepEP's older API had zero_copy fifth: pass it by name)")
        _check_unmeasured(where, "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats)
        zero_copy = _flag(where, "zero_copy", zero_copy)  # before its truth is taken: a shifted tensor has none
        async_finish = _flag(where, "async_finish", async_finish)
        return_recv_hook = _flag(where, "return_recv_hook", return_recv_hook)
        if not zero_copy:
            _check_tensor(where, "x", x)
        try:
            return self.runtime.combine(x, topk_idx, topk_weights, self.active_ranks, self.timeout_us, handle,
                                        zero_copy=zero_copy, async_finish=async_finish,
                                        return_recv_hook=return_recv_hook, out=out)
        except _RENAMED_ERRORS as exc:
            raise _named_as_deepeps(exc, "combine", where) from exc.__cause__

    def get_next_low_latency_combine_buffer(self, handle: Handle) -> torch.Tensor:
        """``[E_l, group_size * T, hidden]`` bf16: write the expert outputs here, then
        ``low_latency_combine(..., zero_copy=True)`` (see :meth:`mooncake_ep.Buffer.get_next_combine_buffer`)."""
        try:
            return self.runtime.get_next_combine_buffer(handle)
        except _RENAMED_ERRORS as exc:
            raise _named_as_deepeps(exc, "get_next_combine_buffer", "get_next_low_latency_combine_buffer") \
                from exc.__cause__

    def _check_shrink(self, where: str) -> None:
        """The mask methods need ``enable_shrink``, as DeepEP's assert ("Shrink mode must be enabled"):
        without it a peer's wait has no timeout by default, and a rank masked here stops signalling the
        peers that still count it live, whose next call would wait for it forever."""
        if not self.enable_shrink:
            raise RuntimeError(f"{where}: the mask buffer needs enable_shrink=True, as DeepEP's does: a rank masked "
                               f"here is no longer signalled, and a peer that still counts it live would wait for it "
                               f"{'forever' if self.timeout_us < 0 else f'{self.timeout_us} us'} (Buffer.active_ranks "
                               f"is the mask without it)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask ``rank_to_mask`` (``mask=True``: nothing is sent to or waited for from it) or admit it
        again (False), from the next call on, on torch's current stream. Needs ``enable_shrink``."""
        self._check_shrink("low_latency_update_mask_buffer")
        rank_to_mask = check_int("low_latency_update_mask_buffer", "rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"low_latency_update_mask_buffer: rank_to_mask must be < group_size={self.group_size}, "
                             f"got {rank_to_mask}")
        mask = _flag("low_latency_update_mask_buffer", "mask", mask)
        self.active_ranks[rank_to_mask] = 0 if mask else 1

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write each rank's mask into ``mask_status`` (``[group_size]`` int32, 1 = masked), on torch's
        current stream. Needs ``enable_shrink``."""
        self._check_shrink("low_latency_query_mask_buffer")
        _check_tensor("low_latency_query_mask_buffer", "mask_status", mask_status)
        if mask_status.dtype != torch.int32 or tuple(mask_status.shape) != (self.group_size,):
            raise ValueError(f"low_latency_query_mask_buffer: mask_status must be [{self.group_size}] int32, got "
                             f"{list(mask_status.shape)} {mask_status.dtype}")
        mask_status.copy_(self.active_ranks == 0)

    def low_latency_clean_mask_buffer(self) -> None:
        """Admit every rank again, on torch's current stream. Needs ``enable_shrink``."""
        self._check_shrink("low_latency_clean_mask_buffer")
        self.active_ranks.fill_(1)

    def destroy(self) -> None:
        """Free the workspace (:meth:`mooncake_ep.Buffer.destroy`)."""
        self.runtime.destroy()

    def _add_recv_count(self, stats: torch.Tensor, recv_count: torch.Tensor, event: EventOverlap,
                        hook: Callable[[], None] | None, async_finish: bool) -> tuple[EventOverlap, Callable | None]:
        """``stats += recv_count`` once the receive has written recv_count: DeepEP's kernels add it
        themselves, so it is ordered as the receive is, and covered by its event."""
        if hook is not None:
            stream = torch.cuda.current_stream(stats.device) if stats.is_cuda else None

            def counted_hook() -> None:
                hook()
                with torch.cuda.stream(stream):  # None (CPU tensors): no stream to switch to
                    _add(stats, recv_count)

            return event, counted_hook
        if async_finish and stats.is_cuda:
            # On the communication stream, after the receive that wrote recv_count, and an event after
            # it: the caller's stream waits for both, as for DeepEP's one kernel, and is not made to wait
            # for them by the add. Not on a stream of its own: a new stream may share a hardware queue
            # with an in-process peer's stream, and its wait for this rank's receive would then hold back
            # the peer's dispatch that the receive waits for (LocalGroup._make_streams).
            comm = self._comm_stream
            if comm is None:
                comm = self._comm_stream = self.get_comm_stream()
            with torch.cuda.stream(comm):
                _add(stats, recv_count)
                done = torch.cuda.Event()
                done.record(comm)
            stats.record_stream(comm)  # recv_count is an output of the call: recorded there already
            return EventOverlap(lambda: torch.cuda.current_stream(stats.device).wait_event(done),
                                extra=event.extra), None
        _add(stats, recv_count)  # the caller's stream, after the receive (or the host's reference result)
        return event, hook


def _refuse_high_throughput(name: str) -> staticmethod:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _high_throughput(f"Buffer.{name}")

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = "DeepEP's high-throughput mode, not built in mooncake_ep: raises NotImplementedError."
    return staticmethod(refuse)


for _name in _HIGH_THROUGHPUT_METHODS:
    setattr(Buffer, _name, _refuse_high_throughput(_name))


def _add(stats: torch.Tensor, recv_count: torch.Tensor) -> None:
    if stats.is_inference():
        # DeepEP's kernels write the counts through the pointer, so a tensor made under
        # torch.inference_mode is written outside it too (torch refuses that in-place add elsewhere).
        with torch.inference_mode():
            stats.add_(recv_count)
    else:  # (entering inference mode costs ~2 us a call)
        stats.add_(recv_count)


def _flag(where: str, name: str, value: Any) -> bool:
    """``value`` as a Python bool, taken as DeepEP's pybind11 bool caster takes it: a bool, numpy's bool or
    an integer (a 0 or 1 read from a config). Anything else, a tensor that DeepEP's older argument orders
    put there included, is a TypeError naming the argument."""
    if isinstance(value, (bool, int, np.bool_, np.integer)):
        return bool(value)
    raise TypeError(f"{where}: {name} must be a bool, got {type_name(value)}")


def _check_tensor(where: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor (DeepEP's API takes torch tensors; mooncake_ep.Buffer "
                        f"takes torch, cupy, JAX and numpy arrays), got {type(value).__name__}")


# The runtime's errors that carry nothing but their message, and so can be made again under DeepEP's name.
_RENAMED_ERRORS = (TypeError, ValueError, RuntimeError, RankMismatchError)
# The runtime's names in its messages' advice, and DeepEP's for them.
_DEEPEPS_NAMES = (("the Handle returned by Buffer.dispatch", "the handle returned by low_latency_dispatch"),
                  ("get_next_combine_buffer(handle)", "get_next_low_latency_combine_buffer(handle)"))


def _named_as_deepeps(exc: Exception, runtime_where: str, where: str) -> Exception:
    """``exc`` of the runtime's call ``runtime_where``, named by the DeepEP method that made it: "dispatch: x
    must be contiguous" reads "low_latency_dispatch: x must be contiguous", and the runtime's methods in its
    advice read as DeepEP's. Another message, or a subclass (which may carry attributes of its own), is
    returned as it is."""
    message = str(exc)
    if type(exc) not in _RENAMED_ERRORS or not message.startswith(f"{runtime_where}: "):
        return exc
    message = message[len(runtime_where) + 2:]
    for runtime_name, deepeps in _DEEPEPS_NAMES:
        message = message.replace(runtime_name, deepeps)
    return type(exc)(f"{where}: {message}")


def _check_unmeasured(where: str, name: str, value: Any) -> None:
    if value is not None:
        raise NotImplementedError(f"{where}: {name} must be None: mooncake_ep's kernels do not measure DeepEP's "
                                  f"per-rank wait times")


def _check_recv_stats(where: str, stats: Any, x: torch.Tensor, num_experts: Any, num_ranks: int) -> None:
    name = "cumulative_local_expert_recv_stats"
    if not isinstance(stats, torch.Tensor):
        hint = " (DeepEP's older API had use_fp8 fifth: pass it by name)" if isinstance(stats, bool) else ""
        raise TypeError(f"{where}: {name} must be an int32 torch.Tensor or None, got {type(stats).__name__}{hint}")
    num_local_experts = check_experts(where, num_experts, num_ranks) // num_ranks  # as the dispatch checks it
    if stats.dtype != torch.int32 or tuple(stats.shape) != (num_local_experts,) or not stats.is_contiguous():
        raise ValueError(f"{where}: {name} must be a contiguous [{num_local_experts}] int32 tensor (one count per "
                         f"local expert), got {list(stats.shape)} {stats.dtype}")
    if stats.device != x.device:
        raise ValueError(f"{where}: {name} is on {stats.device}, x on {x.device}: both must be on one device")
