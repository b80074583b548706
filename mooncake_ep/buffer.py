"""``Buffer``: low-latency dispatch and combine, the Mooncake EP / DeepEP programming model.

One class is the whole user surface. Arrays may come from torch, JAX, cupy or numpy; results come
back in the caller's framework. Arrays in host memory run on the numpy reference backend; CUDA
arrays on the GPU kernels.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from mooncake_ep import _constants, _handshake, frameworks, layout, reference
from mooncake_ep._handshake import CONFIGURATION_FIELDS
from mooncake_ep._reference_backend import ReferenceBackend, refusal_of
from mooncake_ep.group import init_group, is_communicator
from mooncake_ep.tensor import (ArrayView, DeviceMemoryArray, c_contiguous_strides, read_array, same_stream,
                                swapped_last_axes_strides)
from mooncake_ep.validation import (IMMUTABLE_FRAMEWORKS, VECTOR_BYTES, check_allocatable, check_array, check_disjoint,
                                    check_element_aligned, check_expert_ids, check_experts, check_flags, check_hidden,
                                    check_int, check_mutable, check_out, check_same_routing, check_timeout,
                                    check_vector_aligned, check_writable, read_out, stream_handle, type_name)

logger = logging.getLogger("mooncake_ep")

_BUFFER_IDS = itertools.count(1)
# Kernel phase bits (kPhaseSend / kPhaseRecv in kernels_cu/).
_SEND, _RECV = 1, 2


class Handle:
    """What a combine needs from its dispatch. Opaque to callers; valid for the two calls after it.

    Attributes:
        buffer_id: the buffer that made it (a handle from another buffer is refused).
        dispatch_index: which dispatch of that buffer made it (a handle overwritten by later calls is
            refused as stale).
        parity: which half of the workspace the dispatch used.
        num_tokens, hidden, num_topk, num_experts, num_max_dispatch_tokens_per_rank: the shapes.
        backend: ``"cuda"`` or ``"reference"``.
        framework: the caller's framework.
        device_id: CUDA device, or -1 on the CPU.
        state: the receive half's progress (and, on the CPU, the dispatch result).

    Note:
        A value: nothing assigns to its attributes after construction. Compared and hashed by
        identity (every dispatch makes its own). A plain class with ``__slots__`` rather than a
        frozen dataclass: one is made per dispatch, and a frozen dataclass of this many fields costs
        a microsecond more to build.
    """

    __slots__ = ("buffer_id", "dispatch_index", "parity", "num_tokens", "hidden", "num_topk", "num_experts",
                 "num_max_dispatch_tokens_per_rank", "backend", "framework", "device_id", "state", "__weakref__")

    def __init__(self, buffer_id: int, dispatch_index: int, parity: int, num_tokens: int, hidden: int, num_topk: int,
                 num_experts: int, num_max_dispatch_tokens_per_rank: int, backend: str, framework: str,
                 device_id: int, state: dict) -> None:
        self.buffer_id = buffer_id
        self.dispatch_index = dispatch_index
        self.parity = parity
        self.num_tokens = num_tokens
        self.hidden = hidden
        self.num_topk = num_topk
        self.num_experts = num_experts
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.backend = backend
        self.framework = framework
        self.device_id = device_id
        self.state = state

    def __repr__(self) -> str:  # without state, which may hold a whole dispatch result
        return (f"Handle(buffer_id={self.buffer_id}, dispatch_index={self.dispatch_index}, parity={self.parity}, "
                f"num_tokens={self.num_tokens}, hidden={self.hidden}, num_topk={self.num_topk}, "
                f"num_experts={self.num_experts}, num_max_dispatch_tokens_per_rank="
                f"{self.num_max_dispatch_tokens_per_rank}, backend={self.backend!r}, framework={self.framework!r}, "
                f"device_id={self.device_id})")


class _StreamWait:
    """DeepEP's ``EventHandle``: ``current_stream_wait()`` makes the caller's current stream wait."""

    __slots__ = ("current_stream_wait",)

    def __init__(self, wait: Callable[[], None]):
        self.current_stream_wait = wait


class EventOverlap:
    """Completion of a call: a real event when the work ran on the communication stream. It has the
    API of DeepEP's ``EventOverlap``, so engines written for DeepEP use it unchanged.

    ``current_stream_wait()`` makes the caller's current stream wait for it (a no-op when the work is
    already ordered on that stream), then runs the hook of :meth:`register_hook_after_wait`, if any,
    and returns its result; ``with event:`` waits on exit (nothing at all where ``event`` is None, as
    DeepEP's), and ``with event(release_handle=True):`` then also sets ``event`` to None.

    Args:
        wait: makes the current stream wait for the work; None where it is ordered there already.
            An object with ``current_stream_wait()`` (DeepEP's ``EventHandle``, an ``event`` of
            another EventOverlap) is taken too, as DeepEP's ``EventOverlap(event)``.
        extra: arrays kept alive until the work is done.
        event, extra_tensors: DeepEP's names of the two, by keyword.

    Attributes:
        event: an object with ``current_stream_wait()`` (one given is kept as given, as DeepEP's),
            or None where there is nothing to wait for (the work ran on the caller's stream), as
            DeepEP's ``event`` of a call without ``async_finish``; set it to None to let go of it,
            as DeepEP's callers do.
        extra (also ``extra_tensors``): the call's arrays, kept alive until the work is done.
        hook_after_wait: the hook the next :meth:`current_stream_wait` runs, or None (DeepEP's
            attribute; :meth:`register_hook_after_wait` sets it, refusing to replace one).
    """

    def __init__(self, wait: Callable[[], None] | Any = None, extra: Any = None, *, event: Any = None,
                 extra_tensors: Any = None):
        self._event: Any = None
        if wait is not None or event is not None:  # (the common eager call makes one with neither)
            self.event = wait if wait is not None else event
        self.extra = extra if extra is not None else extra_tensors  # arrays kept alive until the work is done
        self.hook_after_wait: Callable[[], Any] | None = None  # DeepEP's attribute, which callers may set
        self._release_on_exit = False

    @property
    def event(self) -> Any:
        return self._event

    @event.setter
    def event(self, event: Callable[[], None] | Any) -> None:
        if event is None or callable(getattr(event, "current_stream_wait", None)):
            self._event = event  # an EventHandle is kept as given, as DeepEP's attribute
        elif callable(event):
            self._event = _StreamWait(event)  # the wait itself (this library's calls pass one)
        else:
            raise TypeError(f"EventOverlap: event must have current_stream_wait() (or be the wait, a callable), got "
                            f"{type(event).__name__}")

    @property
    def extra_tensors(self) -> Any:
        return self.extra

    @extra_tensors.setter
    def extra_tensors(self, extra_tensors: Any) -> None:  # DeepEP's callers let go of them so
        self.extra = extra_tensors

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        if self._event is not None:
            self._event.current_stream_wait()
        result = None
        if self.hook_after_wait is not None:
            result = self.hook_after_wait()  # cleared once it returned: a hook that raised runs again
            self.hook_after_wait = None
        if release_handle:  # the caller's stream is ordered after the work now
            self._event = None
        return result

    def wait(self) -> Any:
        """:meth:`current_stream_wait`, as DeepEP's."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """Run ``hook_after_wait()`` after the next :meth:`current_stream_wait` (on the current stream,
        then ordered after the work), once it returns."""
        if self.hook_after_wait is not None:
            raise RuntimeError("register_hook_after_wait: a hook is already registered on this EventOverlap")
        if not callable(hook_after_wait):
            raise TypeError(f"register_hook_after_wait: hook_after_wait must be callable, got "
                            f"{type(hook_after_wait).__name__}")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> EventOverlap:
        """``with event(release_handle=True):`` sets ``event`` to None once its wait is made on exit."""
        self._release_on_exit = release_handle
        return self

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc_info) -> None:
        release, self._release_on_exit = self._release_on_exit, False
        if self._event is not None:
            self.current_stream_wait(release_handle=release)


def _warn_if_differentiated(where: str, name: str, view: ArrayView) -> None:
    """A torch input of a call that requires grad: warned of in grad mode (no gradient flows back
    through a Buffer call); the attribute read is all the common call pays."""
    if view.framework == "torch" and view.obj.requires_grad:
        frameworks.get("torch").warn_if_differentiated(where, name, view.obj)


def _why_no_gpu() -> str | None:
    """None where ``backend="auto"`` finds a GPU; else why it found none, for the errors of CUDA arrays
    given to the reference Buffer it then builds (a missing cupy reads otherwise as a missing GPU)."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any failure to import is "no cupy", named in the reason
        return (f"cupy could not be imported ({type(exc).__name__}: {exc}); the CUDA backend needs it: "
                f"pip install 'mooncake_ep[cuda12]' (or [cuda13]: the driver's CUDA major version)")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, or a broken one
        return f"cupy found no usable CUDA driver ({type(exc).__name__}: {exc})"
    return None if count > 0 else "cupy found no CUDA device"


@contextlib.contextmanager
def _named_if_no_gpu(backend: str):
    """cupy's own error (cudaErrorInsufficientDriver, no cupy at all) of a ``backend="cuda"`` Buffer on a
    machine without a usable GPU, raised as a RuntimeError that says so (:func:`_why_no_gpu`); any
    other error, or one where a GPU is usable, as it is."""
    try:
        yield
    except Exception as exc:
        from_cupy = (type(exc).__module__.split(".")[0] in ("cupy", "cupy_backends")
                     or (isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "cupy"))
        why = _why_no_gpu() if from_cupy else None
        if why is None:
            raise
        raise RuntimeError(f"Buffer: backend={backend!r}: {why}") from exc


# Every Buffer of this process built and not destroyed: a new Buffer's handshake names those of its
# group (_held_tokens), so that a live rank's new Buffer meeting the others' update is told from a
# replacement process's, which holds none of the Buffers the others update (or only one it built in
# their update, which it may build again: their update of it failed).
_LIVE_BUFFERS: weakref.WeakSet = weakref.WeakSet()
# Buffers built on threads (ranks of one process on a TCP-store group) add while another lists: a
# WeakSet raises "changed size during iteration" there.
_LIVE_BUFFERS_LOCK = threading.Lock()


def _register_live(buffer: Buffer) -> None:
    with _LIVE_BUFFERS_LOCK:
        _LIVE_BUFFERS.add(buffer)


def _held_tokens(group) -> tuple[str, ...]:
    """The tokens of the live Buffers this process holds on ``group``; none for an in-process rank
    (:class:`mooncake_ep.LocalRankGroup`), where no process can die and a new Buffer built on a rank
    while the others update is how a test stands in for a new process."""
    if getattr(group, "is_in_process", False):
        return ()
    with _LIVE_BUFFERS_LOCK:
        buffers = list(_LIVE_BUFFERS)
    return tuple(sorted(b._token for b in buffers
                        if b.group is group and not b._destroyed and not b._built_in_an_update))


class Buffer:
    """A communication buffer for low-latency (decode) expert-parallel dispatch and combine.

    Args:
        group: the ranks (:class:`mooncake_ep.LocalGroup` rank, or :func:`mooncake_ep.init_group`); a
            torch ``ProcessGroup`` or an mpi4py communicator, as Mooncake EP's Buffer takes, is wrapped
            by ``init_group(group)`` (:attr:`group` is then that wrapper).
        num_ep_buffer_bytes: bytes of this rank's workspace; at least
            :meth:`get_ep_buffer_size_hint` for every configuration used.
        num_sms: blocks (one per SM) of each kernel launch; default: the device's SMs shared evenly
            among the ranks on it (threads or processes). Every rank on a GPU must fit at once, since
            a waiting block holds its SM.
        backend: ``"auto"`` (GPU if one is visible, else the numpy reference), ``"cuda"`` or
            ``"reference"``. Host (numpy, CPU torch or JAX) arrays run on the reference path whatever
            the backend; CUDA arrays need the ``"cuda"`` backend (refused on a reference Buffer). A
            host call between two CUDA dispatches counts as a call for the workspace's parity but
            orders no device work: combine a CUDA dispatch (or make another CUDA call) before a
            host-array dispatch follows it, or a peer may still read the rows the next CUDA
            dispatch on that parity restages.
        kernel_cache_dir: where compiled kernels are cached (default: see :mod:`mooncake_ep.kernels`);
            ``~`` is expanded, and a relative path is taken from the working directory.

    Note:
        Every rank must call dispatch and combine in the same order: they are collectives. A
        rank's calls on one Buffer run one after another on the device: two of them in flight at
        once on different streams (say a combine on a side stream while the next runs on the main
        one, with no event between them) share the workspace half of their parity and its step
        counter, and are not supported, as with DeepEP's Buffer. Order them with an event (for an
        ``async_finish`` call, its ``event.current_stream_wait()`` before the next call), or use a
        Buffer per stream.

        Construction is collective too: every rank sends its configuration (version, backend,
        num_ep_buffer_bytes, GPU and num_sms) and a mismatch raises on every rank. On the GPU,
        in-process ranks (:class:`mooncake_ep.LocalGroup`) use the ``local`` transport and ranks
        in separate processes of one host the ``ipc`` one (CUDA IPC); there the first dispatch of
        each configuration (T, hidden, num_experts, fp8 flags) is a collective as well, checking
        that every rank uses the same one (see ``CudaBackend.agree_on``).

        In-process ranks sharing one GPU: whatever synchronises the device (cudaMalloc of a
        framework growing its memory pool, or dispatch/combine allocating results when ``out=`` is
        not given; pinned host allocations; module loads) waits, on one rank's thread, behind peers'
        kernels that are themselves waiting for that rank, until ``timeout_us`` masks it. Allocate
        ahead (``out=``, a warmed pool) and keep such calls between steps, or capture the step in a
        graph; separate processes do not share this hazard. The calls themselves make none: a new
        configuration's layout is copied ahead of the launch on its stream, from pinned memory
        allocated at construction. Each such rank calls on a stream of its own (``LocalGroup.spawn``
        makes one current in each rank's thread): a call on the stream where another rank made the
        same call raises ValueError, unless ``async_finish`` puts it on the rank's communication
        stream, or the stream is capturing a graph (where its replays run is the caller's choice).
    """

    def __init__(self, group, num_ep_buffer_bytes: int, *, num_sms: int | None = None, backend: str = "auto",
                 kernel_cache_dir: str | None = None):
        if is_communicator(group):
            # Mooncake EP's and DeepEP's Buffers take a torch ProcessGroup: wrapped here (an mpi4py
            # communicator too), so that their callers' one line stays one line.
            group = init_group(group)
        missing = [name for name in ("rank", "world_size", "allgather_bytes", "barrier") if not hasattr(group, name)]
        if missing:
            raise TypeError(f"Buffer: group must be a mooncake_ep group (init_group()'s, or a rank of a LocalGroup: "
                            f"rank_group(r), or what spawn passes), a torch ProcessGroup or an mpi4py "
                            f"communicator; {type(group).__name__} has no {missing[0]!r}")
        # Every configuration's regions come after the header (flags, step counters, route table),
        # which the CUDA backend reads and writes at construction.
        check_int("Buffer", "num_ep_buffer_bytes", num_ep_buffer_bytes, minimum=layout.header_bytes())
        if backend not in ("auto", "cuda", "reference"):
            raise ValueError(f"Buffer: backend must be 'auto', 'cuda' or 'reference', got {backend!r}")
        if kernel_cache_dir is not None:  # checked here, before the collectives, on every backend
            from mooncake_ep import kernels

            kernel_cache_dir = kernels.resolve_cache_dir(kernel_cache_dir, "Buffer: kernel_cache_dir")
        if group.world_size > _constants.MAX_RANKS:
            raise ValueError(f"Buffer: at most {_constants.MAX_RANKS} ranks are supported, got {group.world_size}")
        self.group = group
        self.rank = group.rank
        self.num_ranks = group.world_size
        self.num_ep_buffer_bytes = int(num_ep_buffer_bytes)
        self.buffer_id = next(_BUFFER_IDS)
        self._num_dispatches = 0
        # Parities of dispatches whose receive hook is pending, and of the dispatches answered by
        # combines whose receive hook is pending (a dispatch on that parity would rewrite the
        # routing that the hook's receive half reads).
        self._pending_hooks: set[int] = set()
        # (event, arrays): arrays of calls launched on a stream their allocator does not know (async_finish,
        # stream=, two frameworks, another DLPack producer's), held until that event is done.
        self._in_flight: collections.deque = collections.deque()
        self._in_flight_lock = threading.Lock()
        self._pending_combine_hooks: dict[int, int] = {}  # parity -> hooks; a dict: .get is the cheapest miss
        # A random name of this Buffer, made the same on every rank by the handshake (rank 0's):
        # the reference backend's exchanges carry it (ReferenceBackend.exchange).
        self._token = os.urandom(8).hex()
        self._destroyed = False
        # Why this rank's device step counters are behind its peers' (a receive half whose send half
        # ran failed to launch), or None: every launch is refused until update_ep_member.
        self._steps_behind: str | None = None
        # (id(plan), pointers...) of calls already found disjoint and aligned (_check_disjoint).
        self._disjoint_addresses: set[tuple] = set()
        # Views of the workspace's recv_range by (T, hidden, num_experts, parity, framework): made once,
        # as the workspace lives as long as the Buffer (_recv_layout_range; ~12 us to wrap one a call).
        self._recv_range_views: dict[tuple, Any] = {}
        # Checked plans by (call, array signatures, arguments): a call whose arrays have the layouts
        # of an earlier, accepted call skips the layout checks (they would pass again).
        self._plans: dict[tuple, _Plan] = {}
        # The key and plan of the latest dispatch found in _plans: most calls repeat it, and comparing
        # the key with it costs less than hashing the key (~0.7 us of a dispatch's host time).
        self._last_dispatch_plan: tuple = (None, None)
        self._reference = ReferenceBackend(group)
        self._cuda = None
        # In-process ranks of the group on this rank's GPU (set with the CUDA backend): they share one
        # XLA stream, which the JAX ops must know (mooncake_ep.frameworks.jax_ops).
        self._in_process_ranks_on_device = 1
        if num_sms is not None:
            num_sms = check_int("Buffer", "num_sms", num_sms, minimum=1)
        # Why "auto" chose the reference backend, for the errors that a CUDA array then gets.
        self._reference_reason = "backend='reference'" if backend == "reference" else None
        if backend == "auto":
            why = _why_no_gpu()
            if why is not None:
                self._reference_reason = f"backend='auto': {why}"
                torch = sys.modules.get("torch")  # None where an import of it was blocked
                if getattr(getattr(torch, "cuda", None), "is_available", lambda: False)():
                    logger.warning("mooncake_ep: Buffer of rank %d runs on the numpy reference backend, although "
                                   "torch sees a CUDA device: %s", group.rank, why)
        use_cuda = backend == "cuda" or (backend == "auto" and self._reference_reason is None)
        self._num_sms_asked = num_sms or 0
        with _named_if_no_gpu(backend):
            self._device_id = self._choose_device() if use_cuda else None
            my_config = self._rank_config(_handshake.CONSTRUCT)
        # Every rank checks every rank's configuration (the same verdict everywhere), and a process
        # replacing a dead rank continues the survivors' count of dispatches (the next parity).
        configs = _handshake.exchange(group, my_config, "Buffer")
        self._num_dispatches = _handshake.running_dispatches(configs)
        self._token = _handshake.buffer_token(configs)
        # Built in the others' update_ep_member: this process took a dead rank over. Its Buffer is not
        # held against it if it builds the Buffer again (the others' update of it failed and is retried),
        # until the ranks meet on it (a dispatch, an update): then a new Buffer of this live process is
        # the mistake _held_tokens catches.
        self._built_in_an_update = any(config.phase == _handshake.UPDATE for config in configs)
        # The group's membership epoch this Buffer's peers were last connected in (update_ep_member).
        self._membership_epoch = getattr(group, "membership_epoch", None)
        if use_cuda:
            with _named_if_no_gpu(backend):
                self._cuda = self._build_cuda_backend(configs, kernel_cache_dir)
        self.backend = "cuda" if self._cuda is not None else "reference"
        # In-process ranks on one GPU must not make one call on one stream (LocalRankGroup.claim_stream);
        # a call is named by the Buffer's name (equal on every rank) and this count of its launched calls.
        self._claim_stream = getattr(group, "claim_stream", None) if self._in_process_ranks_on_device > 1 else None
        # The kernels check no configuration: every rank's first dispatch of each one is compared
        # instead. Ranks in processes do it in a collective (CudaBackend.agree_on); in-process ranks
        # hold none in a call (one thread may drive every rank), so the group compares their calls
        # (claim_call).
        self._call_claims = group if self._cuda is not None and hasattr(group, "claim_call") else None
        # (T, hidden, num_experts, fp8 flags) this rank launched (in-process) or agreed on (processes)
        self._claimed_configurations: set[tuple] = set()
        self._num_launched_calls = 0
        _register_live(self)

    @property
    def num_sms(self) -> int | None:
        """Blocks (one per SM) of each kernel launch; None on the reference backend."""
        return None if self._cuda is None else self._cuda.num_sms

    @property
    def num_dispatches(self) -> int:
        """Dispatches made on this Buffer so far, the same count on every rank (a replacement process
        continues the survivors'): its parity is the workspace half of the next dispatch."""
        return self._num_dispatches

    @property
    def comm_stream_ptr(self) -> int | None:
        """The ``cudaStream_t`` of the communication stream ``async_finish`` calls run on (an int; None
        on the reference backend)."""
        return None if self._cuda is None else self._cuda.comm_stream.ptr

    @property
    def group_size(self) -> int:
        """The number of ranks, as Mooncake EP's and DeepEP's Buffer name it (:attr:`num_ranks`)."""
        return self.num_ranks

    def _choose_device(self) -> int:
        device_id = getattr(self.group, "device", None)
        if device_id is None:
            import cupy

            device_id = cupy.cuda.runtime.getDevice()
        return int(device_id)

    def _rank_config(self, phase: str) -> _handshake.RankConfig:
        from mooncake_ep import __version__

        num_pending_hooks = len(self._pending_hooks) + sum(self._pending_combine_hooks.values())
        config = _handshake.RankConfig(__version__, phase, "reference" if self._device_id is None else "cuda",
                                       self.num_ep_buffer_bytes, self._num_dispatches, num_pending_hooks,
                                       token=self._token,
                                       held_tokens=_held_tokens(self.group) if phase == _handshake.CONSTRUCT else ())
        if self._device_id is None:
            return config
        from mooncake_ep import _cuda_backend

        device, device_name = _cuda_backend.device_identity(self._device_id)
        # Updating: the blocks its kernels run with, which a replacement on its GPU must leave it.
        num_sms = self._cuda.num_sms if phase == _handshake.UPDATE and self._cuda is not None else self._num_sms_asked
        return dataclasses.replace(config, device=device, device_name=device_name, num_sms=num_sms,
                                   num_device_sms=_cuda_backend.device_sm_count(self._device_id))

    def _build_cuda_backend(self, configs: list[_handshake.RankConfig], kernel_cache_dir: str | None):
        from mooncake_ep import _cuda_backend, kernels

        num_sms = _handshake.num_sms_for(configs, self.rank, "Buffer")
        ranks_here = sum(c.device == configs[self.rank].device for c in configs)
        if getattr(self.group, "is_in_process", False):
            self._in_process_ranks_on_device = ranks_here
        cache = kernels.KernelCache(kernel_cache_dir, name="kernel_cache_dir") if kernel_cache_dir is not None else None
        return _cuda_backend.CudaBackend(self.group, self.num_ep_buffer_bytes, self._device_id, num_sms, cache,
                                         all_on_one_device=ranks_here == self.num_ranks)

    @property
    def device_id(self) -> int:
        """CUDA ordinal of this rank's workspace; -1 on the reference backend."""
        return self._cuda.device_id if self._cuda is not None else -1

    def _prepare(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, *, use_fp8: bool,
                 round_scale: bool, use_ue8m0: bool, where: str = "dispatch") -> None:
        """Check a dispatch's configuration across ranks and put its layout on the device now (see
        ``CudaBackend.agree_on`` and ``layout_for``).

        :meth:`dispatch` does both at its first use of the configuration, and has the layout copied
        by its first launch, on the launch stream; code that records its launches (the JAX ops, whose
        ``buffer_callback`` may run inside an XLA command-buffer recording) calls this beforehand, at
        trace time, where the check (a collective with ``ipc``) and a synchronous copy may run.
        """
        if self._cuda is not None:
            self._cuda.agree_on((num_max_dispatch_tokens_per_rank, hidden, num_experts, use_fp8, round_scale,
                                 use_ue8m0), where)
            self._cuda.layout_for(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            self._cuda.upload_layouts(None)

    def _agree_ahead(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int, *, use_fp8: bool,
                     round_scale: bool, use_ue8m0: bool, where: str) -> None:
        """Agree now on a configuration a later dispatch will use (torch's backward rebuilds a bf16
        dispatch's routing in fp8): with ranks in processes its first use is a collective, which is
        best made while every rank is alive, as the forward's was. Nothing for in-process ranks
        (compared at the call) or where it was agreed already. A new one is checked first, as the
        dispatch would: a numpy int agreed on broke every later update_ep_member (its JSON), a float
        was a bare struct error."""
        configuration = (num_max_dispatch_tokens_per_rank, hidden, num_experts, use_fp8, round_scale, use_ue8m0)
        if self._cuda is not None and self._call_claims is None and configuration not in self._claimed_configurations:
            self._agree_on(where, (check_int(where, "num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank,
                                             minimum=1), hidden, check_experts(where, num_experts, self.num_ranks),
                                   use_fp8, round_scale, use_ue8m0))

    def _agree_on(self, where: str, configuration: tuple) -> None:
        """``CudaBackend.agree_on`` (with ipc, a collective), remembered: the later dispatches of the
        configuration skip it, whatever becomes of the call that made it."""
        self._cuda.agree_on(configuration, where)
        self._claimed_configurations.add(configuration)

    # --- sizing ---------------------------------------------------------------------------------

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                num_experts: int) -> int:
        """Bytes of workspace one rank needs for a configuration.

        The workspace holds, twice (two calls may be in flight): this rank's staged tokens
        (T x 2H bytes and their fp8 scales), its per-expert send lists (T x 16 entries), the dispatch
        layout it received, and the expert outputs peers read in combine (E_l x R x T x H bf16, the
        dominant term); plus epochs, flags and the route table.

        Args:
            num_max_dispatch_tokens_per_rank: T, the most tokens any rank dispatches in one call.
            hidden: H, a multiple of 128.
            num_ranks: R, at most 64.
            num_experts: E, a multiple of R, at most 1024.
        """
        return _workspace_bytes("get_ep_buffer_size_hint", num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                num_experts)

    @staticmethod
    def get_grad_buffer_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                  num_experts: int, num_topk: int) -> int:
        """Bytes of the ``grad_buffer`` of ``mooncake_ep.torch.combine`` / ``mooncake_ep.jax.combine``.

        The gradient of combine is a dispatch of ``num_tokens * num_topk`` rows, one per copy, so
        the gradient's Buffer is sized for ``T * num_topk`` tokens: its receive layout holds
        ``num_local_experts * num_ranks * T * num_topk`` rows, num_topk times the forward's (the cost
        of placing gradient rows exactly with the low-latency kernels). Both front ends export it
        as ``grad_buffer_size_hint``.

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts: as for
                :meth:`get_ep_buffer_size_hint`.
            num_topk: K, in [1, 16].
        """
        where = "grad_buffer_size_hint"
        num_max_dispatch_tokens_per_rank = check_int(where, "num_max_dispatch_tokens_per_rank",
                                                     num_max_dispatch_tokens_per_rank, minimum=1)
        num_topk = check_int(where, "num_topk", num_topk, minimum=1, maximum=_constants.MAX_TOPK)
        return _workspace_bytes(where, num_max_dispatch_tokens_per_rank * num_topk, hidden, num_ranks, num_experts)

    # --- dispatch -------------------------------------------------------------------------------

    def dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                 timeout_us: int = _constants.TIMEOUT_FOREVER, use_fp8: bool = True, async_finish: bool = False,
                 return_recv_hook: bool = False, *, round_scale: bool = False, use_ue8m0: bool = False, out=None,
                 stream=None):
        """Send each token to the ranks owning its top-k experts; receive this rank's experts' tokens.

        The positional arguments are Mooncake EP's, in its order (``... timeout_us, use_fp8,
        async_finish, return_recv_hook``); DeepEP's scale options, ``out`` and ``stream`` are keywords
        only, so that a positional call written for Mooncake EP cannot set them.

        Args:
            x: ``[num_tokens, hidden]`` bf16, num_tokens <= num_max_dispatch_tokens_per_rank, hidden a
                multiple of 128.
            topk_idx: ``[num_tokens, num_topk]`` int64 (int32 accepted) global expert ids; -1 = no expert.
                num_topk <= 16. Host arrays with ids outside [-1, num_experts) are refused; device
                arrays are not read by the host (that would need a sync), and the kernels treat such
                ids as -1. So are a rank's copies to one expert past its first T (recv_x's rows per
                source; only tokens naming an expert twice make them): refused in host arrays, dropped
                by the kernels, in (token, k) order. A host array's refusal goes through the call's
                exchange: the peers' calls raise with it at once (ValueError naming this rank), no
                rank counts the call, and the group stays usable.
            active_ranks: ``[num_ranks]`` int32 on x's device; 1 (any nonzero value) = alive, 0 =
                masked. The kernels write 0 for a rank that timed out; senders skip ranks marked 0.
                A JAX array (immutable, CPU only here) is not written: ``mooncake_ep.jax`` returns the mask.
            num_max_dispatch_tokens_per_rank: T, equal on every rank.
            num_experts: E, a multiple of num_ranks, equal on every rank.
            timeout_us: microseconds a receive waits for a peer before masking it; -1 waits forever. On
                its own flags a rank waits at least 100 ms (they come from its own blocks), and a hook's
                receive half, launched after its send half, not at all (they are there or never come).
            use_fp8: quantise to e4m3 with one fp32 scale per token per 128 channels.
            round_scale: round each scale up to a power of two.
            use_ue8m0: store scales as 8-bit exponents packed four to an int32 (needs round_scale).
            async_finish: run on the buffer's communication stream; the returned event completes it.
            return_recv_hook: launch only the send half; ``hook()`` launches the receive half on the
                same stream (the per-thread default stream, 2, is each thread's own: there, call
                ``hook()`` in the call's thread; another thread's is refused). Exclusive with
                async_finish. Two hooks may be pending; a rank's
                dispatch after them rewrites the rows it staged for the older one, so every rank
                must have called that older hook first (its combine in between, received, as in
                a dispatch-experts-combine step, ensures it; the host can only check its own hooks).
                The receive half reads ``active_ranks`` when it runs: a rank masked by then sends
                this rank nothing, one re-admitted by then is received (if it sent).
            out: ``(recv_x, recv_count)`` arrays to write into, shaped as the results (for graphs); with
                use_fp8 ``((x_fp8, scales), recv_count)``, scales row-major or in DeepEP's layout
                (column-major in their last two dimensions).
            stream: the CUDA stream to launch on instead of the arrays' framework's current one: a
                ``torch.cuda.Stream``, a ``cupy.cuda.Stream``, an object with ``__cuda_stream__``, or
                a ``cudaStream_t`` as an int (1 reads as 0, the legacy default stream; 2, the
                per-thread default stream, is refused: each thread has its own). ``stream`` waits
                for the work queued so far on torch's and cupy's current streams (one event each),
                other DLPack producers order their pending writes on export. Needed for device arrays
                of such producers, which have no current stream (they are otherwise launched on the
                legacy default stream, 0). torch tensors are recorded on it (``record_stream``); the
                call holds the other arrays until its work on ``stream`` is done (an event). The
                results are ready on ``stream``: wait on it before using them elsewhere. With
                async_finish the event's ``current_stream_wait()`` makes ``stream`` wait; without it,
                the event has nothing to wait for.

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``:
            recv_x: ``[num_local_experts, num_ranks * T, hidden]`` bf16, or with use_fp8 a pair
            ``(x_fp8 [num_local_experts, num_ranks * T, hidden] float8_e4m3fn, scales
            [num_local_experts, num_ranks * T, hidden / 128] fp32)`` (int32 ``[..., ceil(hidden / 512)]``
            with use_ue8m0); torch callers get the scales laid out as DeepEP's: column-major in their
            last two dimensions (a transposed view of ``[num_local_experts, hidden / 128, num_ranks *
            T]``, the layout DeepGEMM's TMA loads read), numpy, cupy and JAX callers row-major; rows
            are ordered by source rank, then token; rows past recv_count[e] are undefined.
            recv_count: ``[num_local_experts]`` int32. handle: for combine.
            event: :class:`EventOverlap`. hook: a callable with return_recv_hook, else None.

        Note:
            The host never learns recv_count (that would need a sync and break graph capture).
            Buffers of cupy callers: bf16 and fp8 come back as uint16 / uint8 arrays of the same bits.
            T, num_experts and the flags use_fp8, round_scale, use_ue8m0 must be equal on every rank
            of a call (the reference backend raises RankMismatchError; so does a later in-process
            rank of the CUDA backend at its first dispatch of a configuration, against the first
            rank's same call, whose kernel then waits for it; ranks in several processes check all
            of them at the first dispatch of each configuration, in a collective, and raise it on
            every rank). num_topk and the number of tokens may differ between ranks.
        """
        where = "dispatch"
        if self._destroyed or self._steps_behind is not None:  # the flags first: this is every call's path
            self._check_alive(where)
        given_stream = None if stream is None else stream_handle(where, stream, self._device_id)
        x_view = read_array(x, name="dispatch: x", stream=given_stream)
        _warn_if_differentiated(where, "x", x_view)
        stream_ptr = self._stream_for(where, "x", x_view, given_stream)
        order = _dlpack_stream(x_view, stream_ptr)
        topk_view = read_array(topk_idx, name="dispatch: topk_idx", stream=order)
        active_view = read_array(active_ranks, name="dispatch: active_ranks", stream=order)
        check_flags(where, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                     async_finish=async_finish, return_recv_hook=return_recv_hook)
        check_mutable(where, "x", x_view, out, return_recv_hook)
        timeout_us = check_timeout(where, timeout_us)
        num_max_dispatch_tokens_per_rank = check_int(where, "num_max_dispatch_tokens_per_rank",
                                                     num_max_dispatch_tokens_per_rank, minimum=1)
        out_views = read_out(where, out, use_fp8, order)
        written_tensors = _torch_outputs(where, out_views, _DISPATCH_SPAN_NAMES[use_fp8, True][0])
        # The out= views without their arrays, listed once for the key, the addresses and the launch.
        out_only = None if out_views is None else [view for view, _ in out_views]
        # num_experts's type too: 2.0 equals 2 as a key, and must not find the plan of 2 unchecked. The
        # type before the value: comparing with the latest key stops there for a type no plan was made
        # of (an array, whose == gives no bool), which then fails in the lookup as before.
        key = ("dispatch", _signature(x_view), _signature(topk_view), _signature(active_view),
               num_max_dispatch_tokens_per_rank, type(num_experts), num_experts, use_fp8, use_ue8m0,
               None if out_only is None else tuple(map(_signature, out_only)))
        latest_key, plan = self._last_dispatch_plan
        if key != latest_key:  # a tuple compares as the dict's lookup does: a hit is a hit there
            try:
                plan = self._plans.get(key)
            except TypeError:  # an unhashable num_experts (a list, a 0-d array): the check names it
                check_experts(where, num_experts, self.num_ranks)
                raise
            if plan is not None:
                self._last_dispatch_plan = key, plan
        if plan is None:
            plan = self._plan_dispatch(where, x_view, topk_view, active_view, out_views,
                                       num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0)
            self._remember(key, plan, x_view)
        num_experts = int(num_experts)  # the plan checked it; the Handle and the launch get a Python int
        refusal = None
        if x_view.device_type == "cpu":  # values of host arrays: read every call, refused in the exchange
            refusal = refusal_of(check_expert_ids, where, topk_view, num_experts, num_max_dispatch_tokens_per_rank)
        elif x_view.ptr % VECTOR_BYTES:
            check_vector_aligned(where, "x", x_view, plan.span_nbytes[-2])
        # Addresses: every call, looked up for a remembered plan. Fresh results overlap nothing, but
        # active_ranks (the kernels write it) may overlap an input.
        if out_only is not None:
            addresses = (id(plan), x_view.ptr, topk_view.ptr, active_view.ptr, *[view.ptr for view in out_only])
        else:
            addresses = (id(plan), x_view.ptr, topk_view.ptr, active_view.ptr)
        if addresses not in self._disjoint_addresses:
            self._check_disjoint(where, plan, addresses, _DISPATCH_SPAN_NAMES[use_fp8, out_only is not None],
                                 _dispatch_spans(out_views, active_view, x_view, topk_view), out_only is not None)
        parity = self._num_dispatches % layout.NUM_PARITIES
        if parity in self._pending_hooks:
            raise RuntimeError(f"{where}: the dispatch two calls ago still waits for its hook(); call it first "
                               f"(at most two receive hooks may be pending)")
        if self._pending_combine_hooks.get(parity):
            raise RuntimeError(f"{where}: a combine of the dispatch two calls ago still waits for its hook(), whose "
                               f"receive half reads that dispatch's routing; call it first")
        on_cuda = x_view.device_type == "cuda"
        claimed = None
        off_stream = _NO_FRAMEWORKS  # frameworks of arrays off the launch stream (_wait_for_writers)
        if on_cuda:
            # Compared only at its first use: comparing every call cost ~2 us of host time a dispatch
            # (docs/performance.md (39)).
            configuration = (num_max_dispatch_tokens_per_rank, plan.hidden, num_experts, use_fp8, round_scale,
                             use_ue8m0)  # in CONFIGURATION_FIELDS' order
            if configuration not in self._claimed_configurations:
                if self._call_claims is not None:
                    claimed = self._claim_dispatch(where, configuration, timeout_us)
                else:
                    self._agree_on(where, configuration)
        try:
            outputs = out_views if out_views is not None else self._allocate(plan, x_view)
            handle = Handle(self.buffer_id, self._num_dispatches, parity, plan.num_tokens, plan.hidden, plan.num_topk,
                            num_experts, num_max_dispatch_tokens_per_rank, self.backend if on_cuda else "reference",
                            x_view.framework, x_view.device_id if on_cuda else -1,
                            state={"received": False, "topk_idx_array": topk_idx})  # the caller's, for autograd
            if not on_cuda:
                # The exchange first: ranks found in different calls, or a rank's refusal of its ids, raise
                # there, all of them, uncounted.
                receive = self._reference_dispatch(handle, x_view, topk_view, active_view, outputs,
                                                   dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0),
                                                   refusal)
                self._num_dispatches += 1
                self._built_in_an_update = False  # the ranks made a call on it: it is theirs now (_held_tokens)
            else:
                output_views = out_only if out_only is not None else [view for view, _ in outputs]
                launch = self._dispatch_launcher(x_view, topk_view, active_view, output_views,
                                                 parity=handle.parity,
                                                 num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                                 num_experts=num_experts, timeout_us=timeout_us, use_fp8=use_fp8,
                                                 round_scale=round_scale, use_ue8m0=use_ue8m0)
                off_stream = self._wait_for_writers(stream_ptr, _launch_framework(x_view, given_stream),
                                                    (x_view, topk_view, active_view, *output_views))
                receive = self._launch_halves(where, launch, async_finish, return_recv_hook, stream_ptr)
                # Counted once the send half is launched: a configuration refused on the way (the layout
                # limit, ranks that disagree on it) used no parity, and the handles before it stay valid.
                self._num_dispatches += 1
                self._built_in_an_update = False  # (as on the CPU)
                if claimed is not None:
                    self._claimed_configurations.add(claimed[1])
                    self._call_claims.confirm_call(*claimed)
        except BaseException:
            if claimed is not None:  # nothing launched: the ranks may make this call again, differently
                self._call_claims.withdraw_call(*claimed)
            raise
        if receive is None and not (async_finish or return_recv_hook or given_stream is not None or off_stream
                                    or self._in_flight):
            # The common eager call: both halves launched on the arrays' own stream, with nothing held
            # before it; nothing to record, hold, let go of or defer. Here, not in _finish: the call
            # alone was ~1 us of this path's ~30 (helper-107).
            handle.state["received"] = True
            event, hook = EventOverlap(), None
        else:
            event, hook = self._finish("dispatch", handle, receive, async_finish, return_recv_hook, stream_ptr,
                                       given_stream is not None, off_stream, x_view,
                                       (x_view, topk_view, active_view), outputs)
        if written_tensors:
            frameworks.get("torch").mark_modified(written_tensors)
        objects = _caller_arrays(outputs, x_view)
        recv_x = (objects[0], objects[1]) if use_fp8 else objects[0]
        return recv_x, objects[-1], handle, event, hook

    def _plan_dispatch(self, where: str, x_view: ArrayView, topk_view: ArrayView, active_view: ArrayView,
                       out_views, num_max_tokens: int, num_experts: int, use_fp8: bool, use_ue8m0: bool) -> _Plan:
        """Check everything about a dispatch that its arrays' layouts decide; return what the call needs."""
        num_experts = check_experts(where, num_experts, self.num_ranks)
        check_array(where, "x", x_view, dtypes=("bfloat16",), ndim=2)
        num_tokens, hidden = x_view.shape
        check_hidden(where, "x.shape[1] (hidden)", hidden)
        if num_tokens > num_max_tokens:
            raise ValueError(f"{where}: x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_max_tokens}")
        check_array(where, "topk_idx", topk_view, dtypes=("int64", "int32"), ndim=2, like=x_view)
        if topk_view.shape[0] != num_tokens:
            raise ValueError(f"{where}: topk_idx has {topk_view.shape[0]} rows, x has {num_tokens} tokens")
        num_topk = topk_view.shape[1]
        if not 1 <= num_topk <= _constants.MAX_TOPK:
            raise ValueError(f"{where}: topk_idx.shape[1] (num_topk) must be in [1, {_constants.MAX_TOPK}], "
                             f"got {num_topk}")
        self._check_active(where, active_view, x_view)
        self._check_size(where, num_max_tokens, hidden, num_experts)
        num_local_experts = num_experts // self.num_ranks
        recv_shape = (num_local_experts, self.num_ranks * num_max_tokens, hidden)
        scale_shape = recv_shape[:2] + (reference.num_scale_columns(hidden, use_ue8m0),)
        specs = [("recv_x", recv_shape, "float8_e4m3fn" if use_fp8 else "bfloat16")]
        if use_fp8:
            specs.append(("recv_scales", scale_shape, "int32" if use_ue8m0 else "float32"))
        specs.append(("recv_count", (num_local_experts,), "int32"))
        check_out(where, out_views, specs, x_view, swapped_last_axes=_SWAPPED_RESULTS)
        if out_views is None:
            check_allocatable(where, "x", x_view)
        return _Plan.of(num_tokens, hidden, num_topk, specs, _dispatch_spans(out_views, active_view, x_view, topk_view),
                        swapped_last_axes=_SWAPPED_RESULTS if x_view.framework in _SWAPPING_FRAMEWORKS else ())

    def _check_dispatch(self, where: str, x_view: ArrayView, topk_view: ArrayView, active_view: ArrayView,
                        num_max_dispatch_tokens_per_rank: int, num_experts: int, *, timeout_us: int, use_fp8: bool,
                        round_scale: bool, use_ue8m0: bool) -> _Plan:
        """Every check :meth:`dispatch` makes of these arguments before its exchange, for callers that
        allocate the results: all but the values of host ids (``validation.check_expert_ids``), which
        a rank's exchange carries to its peers as its refusal (``ReferenceBackend.exchange``).

        The JAX ops call it at trace time with shape-only views to declare their results
        (``plan.specs``), and again on the host buffers in their CPU callback. Changes no state.
        """
        self._check_alive(where)
        check_flags(where, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
        check_timeout(where, timeout_us)
        num_max_dispatch_tokens_per_rank = check_int(where, "num_max_dispatch_tokens_per_rank",
                                                     num_max_dispatch_tokens_per_rank, minimum=1)
        return self._plan_dispatch(where, x_view, topk_view, active_view, None, num_max_dispatch_tokens_per_rank,
                                   num_experts, use_fp8, use_ue8m0)

    def _reference_dispatch(self, handle, x_view, topk_view, active_view, outputs, flags, refusal):
        topk = topk_view.numpy().copy()
        handle.state["topk_idx"] = topk  # combine's must be the same (_check_same_routing)
        gathered = self._reference.exchange("dispatch", self._dispatch_call(handle, flags), x_view.numpy().copy(), topk,
                                            active_view.numpy().copy(), refusal=refusal)

        def receive():
            result = self._reference.dispatch(_with_receivers_mask(gathered, self.group.rank, active_view),
                                              handle.num_max_dispatch_tokens_per_rank, handle.num_experts, **flags)
            values = [result.recv_x] + ([result.recv_scales] if flags["use_fp8"] else []) + [result.recv_count]
            for (view, _), value in zip(outputs, values):
                view.numpy()[...] = value
            _write_mask(active_view, result.active_ranks)
            handle.state["result"] = result
        return receive

    def _dispatch_call(self, handle: Handle, flags: dict[str, bool]) -> tuple[tuple[str, object], ...]:
        """A dispatch as ``(field, value)`` pairs: which call, then what every rank must pass alike."""
        configuration = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts,
                         *(flags[name] for name in CONFIGURATION_FIELDS[3:]))
        return (("call", "dispatch"), ("Buffer", self._token), ("dispatch number", handle.dispatch_index),
                *zip(CONFIGURATION_FIELDS, configuration))

    def _claim_dispatch(self, where: str, configuration: tuple, timeout_us: int) -> tuple:
        """Refuse a dispatch of an in-process rank whose peer made the same call with another
        configuration (``LocalRankGroup.claim_call``), before anything is allocated or launched;
        returns what was noted, ``(name, configuration)``, for ``withdraw_call`` should the call
        fail before its launch."""
        name = (self._token, "dispatch", self._num_dispatches)
        first = self._call_claims.claim_call(name, configuration)
        if first is None:
            return name, configuration
        other, theirs_all = first
        field, theirs, mine = next(difference for difference in zip(CONFIGURATION_FIELDS, theirs_all, configuration)
                                   if difference[1] != difference[2])
        # The first rank's kernel runs with its own timeout_us, presumably this rank's.
        waits = "until its timeout_us masks this rank" if timeout_us >= 0 else "forever (timeout_us=-1)"
        raise _handshake.RankMismatchError(
            f"{where}: rank {other} of this process made dispatch number {self._num_dispatches} of this Buffer with "
            f"{field} {theirs!r}, this rank with {mine!r}; every rank must make the same calls, with the same "
            f"arguments, in the same order (only the tokens and num_topk may differ). Nothing was launched here; "
            f"rank {other}'s kernel waits for this rank's dispatch {waits}: make it with rank {other}'s arguments")

    def _dispatch_launcher(self, x_view: ArrayView, topk_view: ArrayView, active_view: ArrayView,
                           out_views: list, *, parity: int, num_max_dispatch_tokens_per_rank: int,
                           num_experts: int, timeout_us: int, use_fp8: bool, round_scale: bool,
                           use_ue8m0: bool) -> Callable[[int, int], None]:
        """The kernel launch of one checked dispatch, as ``launch(phases, stream_ptr)``.

        The one way to the dispatch kernels, for :meth:`dispatch` and for the JAX ops, whose
        ``buffer_callback`` brings XLA's buffers and stream. It reads no host state and allocates
        nothing, so it may run inside a CUDA-graph capture or an XLA command-buffer recording once
        the configuration's layout is on the device (:meth:`_prepare`).

        Args:
            x_view, topk_view, active_view: checked inputs; the kernels update active_view in place.
            out_views: recv_x, [recv_scales,] recv_count (anything with ``.ptr``).
            parity: the workspace half; the caller chooses it (``Handle.parity``).
        """
        cuda = self._cuda
        _, layout_ptr = cuda.layout_for(num_max_dispatch_tokens_per_rank, x_view.shape[1], num_experts)
        recv_scales_ptr, scale_strides = (out_views[1].ptr, _scale_strides(out_views[1])) if use_fp8 else (0, (0, 0))
        return cuda.dispatch_launch(parity, layout_ptr, x_ptr=x_view.ptr, num_tokens=x_view.shape[0],
                                    topk_ptr=topk_view.ptr, topk_is_int64=topk_view.dtype == "int64",
                                    num_topk=topk_view.shape[1], active_ptr=active_view.ptr, recv_x_ptr=out_views[0].ptr,
                                    recv_scales_ptr=recv_scales_ptr, scale_row_stride=scale_strides[0],
                                    scale_column_stride=scale_strides[1], recv_count_ptr=out_views[-1].ptr,
                                    timeout_ns=_timeout_ns(timeout_us), use_fp8=use_fp8, round_scale=round_scale,
                                    use_ue8m0=use_ue8m0)

    # --- combine --------------------------------------------------------------------------------

    def combine(self, x, topk_idx, topk_weights, active_ranks, timeout_us: int = _constants.TIMEOUT_FOREVER,
                handle: Handle | None = None, zero_copy: bool = False, async_finish: bool = False,
                return_recv_hook: bool = False, out=None, renormalize: bool = False, *, stream=None):
        """Bring expert outputs back to the tokens' ranks and sum them with the routing weights.

        Args:
            x: ``[num_local_experts, num_ranks * T, hidden]`` bf16 expert outputs, rows laid out as
                dispatch's recv_x. Ignored (may be None) with zero_copy.
            topk_idx: ``[num_tokens, num_topk]`` the same ids given to the dispatch of ``handle``
                (or -1). Host arrays naming other experts are refused through the call's exchange,
                as dispatch's bad ids are.
            topk_weights: ``[num_tokens, num_topk]`` fp32 routing weights.
            active_ranks: ``[num_ranks]`` int32; the kernels write 0 for an expert rank that timed out
                (not into a JAX array, as in dispatch).
            timeout_us: microseconds to wait for an expert rank before masking it; -1 waits forever. On
                itself a rank waits as in dispatch.
            handle: the handle of the dispatch this combine answers (that dispatch or the one after).
                A handle may be combined again (as DeepEP's tests do) only where its earlier
                combine left nothing in the workspace for peers to read: not after a zero_copy
                combine, a hook combine (which copies), nor where peers read copies of the expert
                outputs (ranks in other processes, or in-process ranks on several GPUs). Those
                combines, and get_next_combine_buffer(handle) after them, are refused
                (RuntimeError): slower peers may still be reading the rows they would rewrite.
            zero_copy: the expert outputs were written into :meth:`get_next_combine_buffer`.
            async_finish, return_recv_hook: as in :meth:`dispatch`. With a hook the expert outputs
                are copied into the workspace by the send half (peers never read ``x`` in place:
                that would make this rank's receive half wait for every peer's hook). The receive
                half reads ``active_ranks`` when it runs, as dispatch's does, and ``topk_idx`` and
                ``topk_weights`` too: keep them as passed.
            out: ``[num_tokens, hidden]`` bf16 array to write into.
            stream: as in :meth:`dispatch`.
            renormalize: scale each token's live weights so they sum to the sum of all its weights
                (live weights summing to 0 are kept as they are for a sum of 0, else dropped).

        Returns:
            ``(combined_x, event, hook)``: combined_x ``[num_tokens, hidden]`` bf16, the fp32 sum of
            weight x expert output over the token's live experts, rounded once.
        """
        where = "combine"
        if self._destroyed or self._steps_behind is not None:  # the flags first: this is every call's path
            self._check_alive(where)
        if handle is None and (isinstance(active_ranks, Handle) or isinstance(timeout_us, Handle)):
            # DeepEP's order, combine(x, topk_idx, topk_weights, handle), or the handle one place early
            misplaced = "active_ranks, the 4th" if isinstance(active_ranks, Handle) else "timeout_us, the 5th"
            raise TypeError(f"{where}: the Handle was passed as {misplaced} argument (mooncake_ep's order is "
                            f"combine(x, topk_idx, topk_weights, active_ranks, timeout_us, handle), DeepEP's "
                            f"has no active_ranks); pass handle=handle")
        self._check_handle_identity(where, handle)
        # On the CPU a state of this rank's handle that refuses the combine (stale, its hook not called)
        # is its verdict in the exchange, as bad ids are: raised before it, it held the peers there.
        refusal = None
        if handle.backend == "reference":
            refusal = refusal_of(self._check_handle_state, where, handle)
            if refusal is None and zero_copy and "combine_buffer" not in handle.state:
                refusal = ValueError(f"{where}: zero_copy=True reads the expert outputs from "
                                     f"get_next_combine_buffer(handle); call it and write them there first, or pass "
                                     f"x with zero_copy=False")
        else:
            self._check_handle_state(where, handle)
        given_stream = None if stream is None else stream_handle(where, stream, self._device_id)
        topk_view = read_array(topk_idx, name="combine: topk_idx", stream=given_stream)
        stream_ptr = self._stream_for(where, "topk_idx", topk_view, given_stream)
        order = _dlpack_stream(topk_view, stream_ptr)
        weights_view = read_array(topk_weights, name="combine: topk_weights", stream=order)
        _warn_if_differentiated(where, "topk_weights", weights_view)
        active_view = read_array(active_ranks, name="combine: active_ranks", stream=order)
        check_flags(where, async_finish=async_finish, return_recv_hook=return_recv_hook, zero_copy=zero_copy,
                    renormalize=renormalize)
        check_mutable(where, "topk_idx", topk_view, out, return_recv_hook)
        timeout_us = check_timeout(where, timeout_us)
        x_view = None
        if not zero_copy:
            if x is None:
                raise TypeError(f"{where}: x (expert outputs) is required unless zero_copy=True")
            x_view = read_array(x, name="combine: x", stream=order)
            _warn_if_differentiated(where, "x", x_view)
        out_views = None if out is None else [(read_array(out, name="combine: out combined_x", stream=order), out)]
        written_tensors = _torch_outputs(where, out_views, ("out combined_x",))
        key = ("combine", _signature(topk_view), _signature(weights_view), _signature(active_view),
               None if x_view is None else _signature(x_view), handle.num_tokens, handle.num_topk, handle.hidden,
               handle.num_experts, handle.num_max_dispatch_tokens_per_rank, handle.device_id,
               None if out_views is None else _signature(out_views[0][0]))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan_combine(where, handle, topk_view, weights_view, active_view, x_view, out_views)
            self._remember(key, plan, topk_view)
        if topk_view.device_type == "cpu":  # values of host arrays: read every call, refused in the exchange
            if refusal is None:
                refusal = refusal_of(self._check_same_routing, where, handle, topk_view)
        elif x_view is not None and x_view.ptr % VECTOR_BYTES:
            check_vector_aligned(where, "x", x_view, plan.span_nbytes[-3])
        # Addresses: every call, looked up for a remembered plan (as dispatch's).
        combined_view = None if out_views is None else out_views[0][0]
        addresses = (id(plan), topk_view.ptr, weights_view.ptr, active_view.ptr,
                     -1 if combined_view is None else combined_view.ptr, -1 if x_view is None else x_view.ptr)
        if addresses not in self._disjoint_addresses:
            self._check_disjoint(where, plan, addresses, _COMBINE_SPAN_NAMES[x_view is None, combined_view is not None],
                                 _combine_spans(combined_view, active_view, x_view, topk_view, weights_view),
                                 combined_view is not None)
        # A combine through the workspace (zero-copy, a hook's copy, ranks reading copies) has peers read
        # get_next_combine_buffer(handle)'s memory while its receive half writes: nothing written may
        # lie there. Remembered as the addresses are, with the parity that places the buffer.
        read_in_place = not (zero_copy or return_recv_hook) and self._peers_read_in_place(handle)
        if not read_in_place:
            outside = (addresses, handle.parity)
            if outside not in self._disjoint_addresses:
                self._check_outside_combine_buffer(where, handle, (("out combined_x", combined_view),
                                                                   ("active_ranks", active_view)))
                if handle.backend == "cuda":
                    self._remember_checked(outside)
        outputs = out_views if out_views is not None else self._allocate(plan, topk_view)
        off_stream = _NO_FRAMEWORKS
        if handle.backend == "reference":
            receive = self._reference_combine(handle, x_view, topk_view, weights_view, active_view, outputs,
                                              zero_copy, renormalize, refusal)
        else:
            # Never in place with a hook: a receive half that reads in place waits until every peer has
            # read this rank's outputs, i.e. until every peer's hook ran, where a hook's receive half must
            # wait for the peers' send halves alone (a caller waiting for one rank's hook before calling
            # the next rank's waited forever, or past timeout_us, which masked a live peer still reading).
            launch = self._combine_launcher(x_view, topk_view, weights_view, active_view, outputs[0][0],
                                            parity=handle.parity,
                                            num_max_dispatch_tokens_per_rank=handle.num_max_dispatch_tokens_per_rank,
                                            hidden=handle.hidden, num_experts=handle.num_experts, zero_copy=zero_copy,
                                            renormalize=renormalize, timeout_us=timeout_us,
                                            direct_reads=not return_recv_hook)
            # zero_copy: the expert outputs were written into get_next_combine_buffer's array, of the
            # dispatch's framework, on its current stream.
            written_before = (handle.framework,) if zero_copy else ()
            off_stream = self._wait_for_writers(stream_ptr, _launch_framework(topk_view, given_stream),
                                                (x_view, topk_view, weights_view, active_view, outputs[0][0]),
                                                written_before)
            receive = self._launch_halves(where, launch, async_finish, return_recv_hook, stream_ptr)
        if zero_copy:
            handle.state["combined_through_workspace"] = "zero_copy=True"
        elif return_recv_hook:  # direct_reads=False above
            handle.state["combined_through_workspace"] = "return_recv_hook=True, which copies"
        elif not read_in_place:
            handle.state["combined_through_workspace"] = "ranks whose peers read copies there"
        if receive is None and not (async_finish or return_recv_hook or given_stream is not None or off_stream
                                    or self._in_flight):
            event, hook = EventOverlap(), None  # the common eager call, as dispatch's
        else:
            event, hook = self._finish("combine", handle, receive, async_finish, return_recv_hook, stream_ptr,
                                       given_stream is not None, off_stream, topk_view,
                                       (x_view, topk_view, weights_view, active_view), outputs)
        if written_tensors:
            frameworks.get("torch").mark_modified(written_tensors)
        return _caller_arrays(outputs, topk_view)[0], event, hook

    def _peers_read_in_place(self, handle: Handle) -> bool:
        """Whether peers read this rank's expert outputs (of a combine without a hook, which always
        copies) where the caller holds them, not from copies in the workspace that a second combine
        of ``handle`` would rewrite while they may still read.

        The reference backend's exchange has no such hazard; it answers as the kernels would for ranks
        placed as its group's are (in processes, or in one process on several GPUs: copies), so that a
        CPU test refuses what a GPU run would. Host arrays on a CUDA Buffer answer as its kernels.
        """
        if self._cuda is not None:
            return self._cuda.direct_peer_reads
        if not getattr(self.group, "is_in_process", False):
            return False
        devices = getattr(getattr(self.group, "local_group", None), "devices", None)  # a LocalRankGroup's
        return devices is None or len(set(devices)) == 1

    def _plan_combine(self, where: str, handle: Handle, topk_view: ArrayView, weights_view: ArrayView,
                      active_view: ArrayView, x_view: ArrayView | None, out_views) -> _Plan:
        """Check everything about a combine that its arrays' layouts decide; return what the call needs."""
        num_local_experts = handle.num_experts // self.num_ranks
        expected = (handle.num_tokens, handle.num_topk)
        check_array(where, "topk_idx", topk_view, dtypes=("int64", "int32"), shape=expected)
        check_array(where, "topk_weights", weights_view, dtypes=("float32",), shape=expected, like=topk_view)
        self._check_active(where, active_view, topk_view)
        if (topk_view.device_id if topk_view.device_type == "cuda" else -1) != handle.device_id:
            raise TypeError(f"{where}: topk_idx is on {topk_view.device_type}:{topk_view.device_id}, the dispatch "
                            f"of handle ran on {'cpu' if handle.device_id < 0 else f'cuda:{handle.device_id}'}")
        if x_view is not None:
            shape = (num_local_experts, self.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
            check_array(where, "x", x_view, dtypes=("bfloat16",), shape=shape, like=topk_view)
        specs = (("combined_x", (handle.num_tokens, handle.hidden), "bfloat16"),)
        check_out(where, out_views, specs, topk_view)
        if out_views is None:
            check_allocatable(where, "topk_idx", topk_view)
        combined_view = None if out_views is None else out_views[0][0]
        spans = _combine_spans(combined_view, active_view, x_view, topk_view, weights_view)
        return _Plan.of(handle.num_tokens, handle.hidden, handle.num_topk, specs, spans)

    def _check_combine(self, where: str, handle, x_view: ArrayView, topk_view: ArrayView, weights_view: ArrayView,
                       active_view: ArrayView, *, timeout_us: int) -> _Plan:
        """Every check :meth:`combine` makes of these arrays against a dispatch, for callers that allocate.

        ``handle`` is a :class:`Handle` or anything with its shape fields and ``device_id`` (the JAX
        ops pass their dispatch's configuration, device -1 at trace time). Changes no state.
        """
        self._check_alive(where)
        check_timeout(where, timeout_us)
        return self._plan_combine(where, handle, topk_view, weights_view, active_view, x_view, None)

    def _reference_combine(self, handle, x_view, topk_view, weights_view, active_view, outputs, zero_copy,
                           renormalize, refusal):
        expert_out = metadata = None  # a refusal sends none
        if refusal is None:
            expert_out = (handle.state["combine_buffer"] if zero_copy else x_view.numpy()).copy()
            metadata = self._reference.dispatch_metadata(handle.state["result"])
        # The handle's dispatch number names the call: a replacement process continues the count.
        call = (("call", "combine"), ("Buffer", self._token), ("handle's dispatch number", handle.dispatch_index),
                ("hidden", handle.hidden), ("num_experts", handle.num_experts))
        gathered = self._reference.exchange("combine", call, expert_out, metadata, active_view.numpy().copy(),
                                            refusal=refusal)
        topk, weights = topk_view.numpy().copy(), weights_view.numpy().copy()

        def receive():
            combined, mask = self._reference.combine(_with_receivers_mask(gathered, self.group.rank, active_view), topk,
                                                     weights, renormalize=renormalize)
            outputs[0][0].numpy()[...] = combined
            _write_mask(active_view, mask)
        return receive

    def _combine_launcher(self, x_view: ArrayView | None, topk_view: ArrayView, weights_view: ArrayView,
                          active_view: ArrayView, combined_view, *, parity: int, num_max_dispatch_tokens_per_rank: int,
                          hidden: int, num_experts: int, zero_copy: bool, renormalize: bool,
                          timeout_us: int, direct_reads: bool = True) -> Callable[[int, int], None]:
        """The kernel launch of one checked combine, as ``launch(phases, stream_ptr)``.

        The one way to the combine kernels, for :meth:`combine` and the JAX ops; like
        :meth:`_dispatch_launcher` it reads no host state and allocates nothing. ``parity`` is the
        parity of the dispatch whose routing this combine answers; ``x_view`` is None with zero_copy.
        ``direct_reads=False``: peers never read ``x_view`` in place (both halves of a combine must
        agree; the JAX split form, whose receive halves share one stream, needs it).
        """
        cuda = self._cuda
        _, layout_ptr = cuda.layout_for(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return cuda.combine_launch(parity, layout_ptr, expert_out_ptr=0 if zero_copy else x_view.ptr,
                                   zero_copy=zero_copy, num_tokens=topk_view.shape[0], topk_ptr=topk_view.ptr,
                                   topk_is_int64=topk_view.dtype == "int64", num_topk=topk_view.shape[1],
                                   weights_ptr=weights_view.ptr, active_ptr=active_view.ptr,
                                   combined_ptr=combined_view.ptr, renormalize=renormalize,
                                   timeout_ns=_timeout_ns(timeout_us), direct_reads=direct_reads)

    def get_next_combine_buffer(self, handle: Handle):
        """The buffer to write expert outputs into for ``combine(..., zero_copy=True)``.

        Returns:
            ``[num_local_experts, num_ranks * T, hidden]`` bf16 in the caller's framework, laid out as
            dispatch's recv_x; it belongs to the buffer and is reused two calls later. Device memory
            of another DLPack producer gets a :class:`~mooncake_ep.tensor.DeviceMemoryArray`, which
            any framework's ``from_dlpack`` takes.

        Raises:
            TypeError: the dispatch's arrays were JAX arrays, which cannot be written in place.
        """
        self._check_alive("get_next_combine_buffer", launches=False)
        self._check_handle("get_next_combine_buffer", handle)
        if handle.framework in IMMUTABLE_FRAMEWORKS:
            raise TypeError(f"get_next_combine_buffer: the dispatch's arrays are {handle.framework} arrays, which "
                            f"cannot be written in place; a zero-copy combine needs a torch, cupy or numpy caller "
                            f"(JAX callers pass their expert outputs to combine)")
        shape = self._combine_buffer_shape(handle)
        if handle.backend == "reference":
            buffer = handle.state.get("combine_buffer")
            if buffer is None:
                buffer = handle.state["combine_buffer"] = np.zeros(shape, dtype=reference.bfloat16)
            array = DeviceMemoryArray(buffer.ctypes.data, shape, "bfloat16", "cpu", 0, owner=buffer)
        else:
            array = DeviceMemoryArray(self._combine_buffer_ptr(handle), shape, "bfloat16", "cuda", handle.device_id,
                                      owner=self)
            if handle.framework == "dlpack":  # no framework of ours holds device memory of that producer
                return array
        return frameworks.get(handle.framework).wrap(array)

    def _recv_layout_range(self, where: str, handle: Handle):
        """Where each source rank's rows lie among each local expert's received rows, for the dispatch
        of ``handle`` (DeepEP's ``layout_range``); the autograd functions move gradient rows with it
        between the layouts of two dispatches.

        Returns:
            ``[num_local_experts, num_ranks, 2]`` int32 in the handle's framework: (first row, rows) of
            source rank r in local expert e. Rows 0 for a source not received, and for one whose rows
            the dispatch wrote as zeros (it timed out staging; recv_count still counts them). The
            first rows are nondecreasing along r, and each range ends at or before the next begins.
            On the CPU the dispatch result's array; on the GPU a view of the workspace (``recv_range``
            of the handle's parity, the same object for every handle of that parity and
            configuration), written by the dispatch's receive and rewritten by the dispatch two calls
            later: copy it before then, ordered after the dispatch as a combine of the handle is (on
            torch's current stream in :mod:`mooncake_ep.torch`).

        Raises:
            TypeError, ValueError, RuntimeError: as :meth:`combine` for a handle it refuses.
        """
        self._check_alive(where, launches=False)
        self._check_handle(where, handle)
        if handle.backend == "reference":
            ranges = handle.state["result"].layout_range
            array = DeviceMemoryArray(ranges.ctypes.data, ranges.shape, "int32", "cpu", 0, owner=ranges)
            return frameworks.get(handle.framework).wrap(array)
        key = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, handle.parity,
               handle.framework)
        view = self._recv_range_views.get(key)
        if view is None:
            workspace_layout, _ = self._cuda.layout_for(handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                                                        handle.num_experts)
            view = DeviceMemoryArray(self._cuda.workspace.ptr + workspace_layout.offsets["recv_range"][handle.parity],
                                     (handle.num_experts // self.num_ranks, self.num_ranks, 2), "int32", "cuda",
                                     handle.device_id, owner=self._cuda.workspace)  # not self: kept here, a cycle
            if handle.framework != "dlpack":  # no framework of ours holds device memory of that producer
                view = frameworks.get(handle.framework).wrap(view)
            self._recv_range_views[key] = view
        return view

    def _combine_buffer_shape(self, handle: Handle) -> tuple[int, int, int]:
        return (handle.num_experts // self.num_ranks, self.num_ranks * handle.num_max_dispatch_tokens_per_rank,
                handle.hidden)

    def _combine_buffer_ptr(self, handle: Handle) -> int:
        """The device address of get_next_combine_buffer(handle) (CUDA backend): its parity's combine_x."""
        workspace_layout, _ = self._cuda.layout_for(handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                                                    handle.num_experts)
        return self._cuda.workspace.ptr + workspace_layout.offsets["combine_x"][handle.parity]

    def _check_outside_combine_buffer(self, where: str, handle: Handle, written) -> None:
        """A combine through the workspace has its expert outputs read from get_next_combine_buffer(handle)'s
        memory, here and by peers: none of the ``written`` (name, view) pairs may lie there. (The
        reference backend's buffer exists once get_next_combine_buffer made it: before, nothing can.)"""
        if handle.backend == "reference":
            buffer = handle.state.get("combine_buffer")
            if buffer is None:
                return
            start, nbytes = buffer.ctypes.data, buffer.nbytes
        else:
            start, nbytes = self._combine_buffer_ptr(handle), math.prod(self._combine_buffer_shape(handle)) * 2
        written = [(name, view) for name, view in written if view is not None]
        # The one overlap rule: the written arrays, then the buffer as an array the call reads.
        check_disjoint(where, (*(name for name, _ in written), "get_next_combine_buffer(handle), whose memory the "
                                                               "combine's peers read"),
                       [*(view for _, view in written), types.SimpleNamespace(ptr=start)],
                       (*(view.nbytes for _, view in written), nbytes), len(written))

    def update_ep_member(self) -> list[int]:
        """Take in the group's current members and re-exchange the route table (collective).

        After a rank's process died (its peers' kernels masked it) and a replacement process took
        over its rank (``init_group(rejoin=True)``, then ``Buffer(...)`` as at the start), every
        survivor calls this; it returns when the replacement's Buffer is connected. A group with
        ``renew_membership`` (the store groups) starts its next membership epoch first, which also
        repairs a group broken by a timed-out collective; the configurations are then checked
        again and, on the GPU, the peers' workspaces re-mapped (the dead one's mapping closed).
        On the GPU it also brings back a Buffer whose receive half failed to launch after its send
        half ran (its step counters fell behind the peers'), which refuses every launch until then.
        Several Buffers of one group (a forward Buffer and a ``grad_buffer``): every survivor
        updates each of them, in the order in which the replacement builds them; the first update
        starts the epoch and the others join it (as does a retry of a refused update), unless the
        group broke since.

        Returns:
            The ranks whose process was replaced, ascending: set ``active_ranks[r] = 1`` for them
            (the kernels wrote 0 when they timed out) so that the next step includes them.

        Raises:
            GroupError: a rank did not come within the group's timeout (it is named).
            ValueError, RuntimeError: the ranks' configurations differ, a replacement's GPU has too few
                SMs left beside the running ranks there, or a rank has receive hooks pending (raised on
                every rank).
            RankMismatchError: a rank whose process lives builds a new Buffer instead of updating its
                own (its process holds this Buffer; only a process that took over a dead rank builds
                one here); raised on every rank, nothing changed, and the update can be retried.
            TransportError: a replacement's workspace could not be mapped (the Buffer keeps its peers
                as they were, and the update can be retried).

        Note:
            Call it between steps, with no hook pending and nothing being captured; every rank
            must call it (survivors) or build its Buffer (replacements) at the same point.
        """
        self._check_alive("update_ep_member", launches=False)
        renew = getattr(self.group, "renew_membership", None)
        epoch = getattr(self.group, "membership_epoch", None)
        # One epoch per change of members, whatever the number of Buffers: the replacement joins one
        # round (init_group(rejoin=True)), then builds each Buffer in it. An epoch newer than this
        # Buffer's was started by another Buffer's update, or by this one's refused after renewing.
        if renew is not None and (epoch is None or epoch == self._membership_epoch or
                                  getattr(self.group, "broken", None) is not None):
            renew()
        configs = _handshake.exchange(self.group, self._rank_config(_handshake.UPDATE), "update_ep_member")
        self._num_dispatches = _handshake.running_dispatches(configs)  # equal on the GPU, the most on the CPU
        self._built_in_an_update = False  # the ranks met in an update of it: it is theirs now (_held_tokens)
        replaced = _handshake.replaced_ranks(configs)
        if self._cuda is not None:
            # The replacements check in Buffer(), on the same configs: every rank raises, or none.
            _handshake.num_sms_for(configs, self.rank, "update_ep_member")
            self._cuda.connect(replaced)  # every rank's step counters brought to the highest
            self._steps_behind = None
        self._membership_epoch = getattr(self.group, "membership_epoch", None)
        return replaced

    def destroy(self) -> None:
        """Free the workspace after every rank is done with it (collective; idempotent).

        On the GPU each rank waits for its own kernels, then (barrier) closes its mappings of the
        peers' workspaces, then (barrier) frees its own: CUDA requires that no peer still maps it.
        Ranks of one process free after one barrier, and return after another, all of them freed.
        A Buffer dropped without destroy() is released when garbage-collected, without waiting
        for the peers (no collective can run there): destroy() on every rank is the safe way. One
        a JAX op has used is not collected while JAX's caches hold the programs traced with it
        (they may replay its launches without calling back): free it with
        ``mooncake_ep.jax.destroy_buffers``, which also clears those caches.
        """
        self._destroyed = True
        try:
            if self._cuda is not None:
                cuda, self._cuda = self._cuda, None
                cuda.destroy()  # after this process's work on the device is done
        finally:
            self._in_flight.clear()
            self._recv_range_views.clear()  # views of the freed workspace

    def _check_alive(self, where: str, *, launches: bool = True) -> None:
        """RuntimeError if this Buffer was destroyed, or, for a call that ``launches``, if its step
        counters are behind its peers'."""
        if self._destroyed:
            raise RuntimeError(f"{where}: this Buffer was destroyed; build a new one")
        if launches and self._steps_behind is not None:
            raise RuntimeError(f"{where}: {self._steps_behind}, after its send half ran, so this rank's step "
                               f"counters are behind its peers' (they move at the end of a receive half): its next "
                               f"call would take that call's step and could accept the peers' flags of it over "
                               f"their later data. Call update_ep_member() on every rank, which brings them to the "
                               f"peers'; then set active_ranks[r] = 1 for any rank masked meanwhile")

    # --- shared steps ---------------------------------------------------------------------------

    def _stream_for(self, where: str, name: str, view: ArrayView, given_stream: int | None = None) -> int:
        """The launch stream for a CUDA array: ``given_stream`` (the call's ``stream=``) if given, else
        its framework's current stream (0 for host arrays), checking the backend; ``name``: the call's
        first array, ``view``."""
        if view.device_type == "cpu":
            if given_stream is not None:
                raise ValueError(f"{where}: stream is for CUDA arrays; {name} is a host array (the reference "
                                 f"backend runs on the calling thread)")
            return 0
        if self._cuda is None:
            raise TypeError(f"{where}: {name} is on cuda:{view.device_id}, and this Buffer runs on the numpy "
                            f"reference backend ({self._reference_reason}); build the Buffer where a GPU is "
                            f"visible, with cupy installed")
        if view.device_id != self._cuda.device_id:
            raise TypeError(f"{where}: {name} is on cuda:{view.device_id}, this Buffer's rank uses "
                            f"cuda:{self._cuda.device_id}")
        if given_stream is not None and view.framework not in IMMUTABLE_FRAMEWORKS:  # JAX's refusal below
            return given_stream
        return frameworks.get(view.framework).current_stream(view.device_id)

    def _wait_for_writers(self, stream_ptr: int, launch_framework: str | None, views: tuple,
                          frameworks_written: tuple[str, ...] = ()) -> frozenset:
        """Make ``stream_ptr`` wait for the work queued so far on the current stream of every framework
        among the call's torch and cupy arrays (``views``; None entries skipped) and
        ``frameworks_written``, where that stream is another: their writes of the inputs, and their
        earlier use of the memory of freshly allocated results, which their allocators hand out in
        that stream's order. read_array reads such arrays directly, ordering nothing. One event per
        framework and call (``launch_framework``: the one whose current stream is the launch
        stream by construction, skipped); other DLPack producers ordered themselves on export. While
        the launch stream captures a graph nothing is waited for: the graph cannot depend on
        uncaptured work, and its replays are ordered by the caller, as any graph's are.

        Returns the frameworks of the call's device arrays whose allocators' streams may not order
        their reuse after the launch: torch and cupy where the current stream is another, and other
        DLPack producers than the launch framework (their allocators' streams are unknown). _finish
        keeps those arrays (record_stream, or held until the kernels are done)."""
        others = None  # the common case, every array of the launch framework, builds nothing
        for view in views:
            if view is not None and view.framework != launch_framework and view.device_type == "cuda":
                others = (others or set()) | {view.framework}
        for framework in frameworks_written:
            if framework != launch_framework:
                others = (others or set()) | {framework}
        if others is None:
            return _NO_FRAMEWORKS
        off = others - set(_STREAM_FRAMEWORKS)
        capturing = None
        for framework in _STREAM_FRAMEWORKS:
            if framework in others:
                current = frameworks.get(framework).current_stream(self._cuda.device_id)
                if not same_stream(current, stream_ptr):
                    off.add(framework)
                    if capturing is None:
                        capturing = self._cuda.stream_is_capturing(stream_ptr)
                    # A captured graph cannot wait for work outside its capture (CUDA refuses it:
                    # cudaErrorStreamCaptureIsolation); where its replays run is the caller's order.
                    if not capturing:
                        self._cuda.stream_wait(stream_ptr, self._cuda.record_event(current))
        return frozenset(off)

    def _launch_stream(self, async_finish: bool, stream_ptr: int) -> int:
        if not async_finish:
            return stream_ptr
        ready = self._cuda.record_event(stream_ptr)
        self._cuda.stream_wait(self._cuda.comm_stream.ptr, ready)
        return self._cuda.comm_stream.ptr

    def _launch_halves(self, where: str, launch: Callable[[int, int], None], async_finish: bool,
                       return_recv_hook: bool, stream_ptr: int) -> Callable[[], None] | None:
        """Launch both halves now in one kernel, or the send half now and return the receive half as the hook's work.

        A send half never waits on a peer; only receive halves (which can time out) wait, so the
        hook mode holds no SM between its two launches. ``launch(phases, stream)`` launches.

        Raises:
            ValueError: in-process ranks on one GPU call on one stream (nothing is launched).
        """
        if self._claim_stream is not None and not async_finish:
            other = self._claim_stream(self._cuda.device_id, stream_ptr, (self._token, self._num_launched_calls))
            # A capture runs nothing: where its graphs are replayed is the caller's to choose.
            if other is not None and not self._cuda.stream_is_capturing(stream_ptr):
                raise ValueError(
                    f"{where}: rank {self.rank} calls on stream {stream_ptr:#x} of cuda:{self._cuda.device_id}, where "
                    f"rank {other} of this process made the same call; ranks sharing a stream serialise, and a "
                    f"rank's receive half would wait for a peer's send queued behind it until the timeout masked "
                    f"that peer. Give each rank a stream of its own (LocalGroup.spawn makes one current in each "
                    f"rank's thread; or pass it as stream=), or pass async_finish=True (each rank's communication "
                    f"stream)")
        launch_stream = self._launch_stream(async_finish, stream_ptr)
        if return_recv_hook:
            launch(_SEND, launch_stream)
            self._num_launched_calls += 1
            return lambda: launch(_RECV, stream_ptr)
        launch(_SEND | _RECV, launch_stream)
        self._num_launched_calls += 1
        return None

    def _finish(self, call: str, handle: Handle, receive, async_finish, return_recv_hook, stream_ptr,
                stream_given: bool, off_stream: frozenset, like: ArrayView, inputs: tuple[ArrayView | None, ...],
                outputs: list[tuple[ArrayView, Any]]):
        """Run or defer the receive half; build the event and the hook (of every call but the common
        eager one, which dispatch and combine finish themselves).

        ``call`` is ``"dispatch"`` (``handle`` its own: marked received once the receive half ran,
        failed if it raised) or ``"combine"`` (``handle`` the dispatch it answers). A pending hook
        is counted until it ran, or raised: a hook is called once, so one that raised is no longer
        pending (its dispatch's handle is then refused by combine with the hook's error, whichever call's
        hook it was).

        With async_finish the kernel runs on the communication stream, not the one the caller's
        arrays (``inputs``, and the views of ``outputs``) were made on. As DeepEP does, the arrays are kept
        alive by the event (``EventOverlap.extra``), and torch tensors are also recorded on the
        communication stream, so that torch's allocator does not give a dropped one's memory to new
        work on the caller's stream before the kernel is done with it. So are they with ``stream=``
        (``stream_given``: ``stream_ptr`` is that stream) where it is not torch's current one; the
        event of such a call makes that stream wait, not the current one. And so are they where some
        array's framework runs on another stream than the launch (``off_stream``, _wait_for_writers's
        frameworks: arrays of two frameworks in one call, or of another DLPack producer). The arrays
        of those frameworks (all of them with async_finish, torch's included: recording does nothing
        for memory torch did not allocate) are also held by the Buffer until the kernels are done
        (_hold_until_done): callers drop the event.
        """
        views = None  # the call's arrays, where the kernels run on another stream than torch's current one
        held = ()  # their keepalives that no allocator's stream order protects: held until the kernels are done
        if like.device_type == "cuda" and (async_finish or stream_given or off_stream):
            views = [view for view in inputs if view is not None] + [view for view, _ in outputs]
            self._record_on(async_finish, stream_ptr, views)
            # torch tensors too: record_stream does nothing for memory torch's allocator did not make
            # (torch.from_dlpack of a JAX or cupy array), which its owner may reuse on its own stream.
            held = tuple(view.keepalive for view in views if async_finish or view.framework in off_stream)
        # Nothing is let go of or held while the stream captures a graph: an event query there would end
        # the capture, and a graph's arrays must outlive its replays, the caller's care. (The communication
        # stream of async_finish captures with the caller's: _launch_stream made it wait there.)
        capturing = (like.device_type == "cuda" and bool(self._in_flight or held)
                     and self._cuda.stream_is_capturing(stream_ptr))
        if self._in_flight and like.device_type == "cuda" and not capturing:
            self._let_go_of_done()
        if return_recv_hook:
            if call == "dispatch":
                self._pending_hooks.add(handle.parity)
            else:
                self._pending_combine_hooks[handle.parity] = self._pending_combine_hooks.get(handle.parity, 0) + 1
                handle.state["combine_hook_pending"] = True
            called = []
            # The call's arrays live until the receive half is launched: it writes the outputs, and
            # with direct reads in-process peers read a combine's x in their receive halves, which
            # this rank's own receive half waits for. Dropped by the caller meanwhile, their memory
            # could go to new work, which the kernels would then read or overwrite.
            arrays = dict(inputs=inputs, outputs=outputs, held=held)  # cleared once launched: the hook may outlive it
            # The per-thread default stream (a cupy current stream under CUPY_CUDA_PER_THREAD_DEFAULT_STREAM)
            # names another stream in each thread: launched from another thread, the receive half would
            # run unordered after its send half.
            launching_thread = threading.get_ident() if stream_ptr == _constants.PER_THREAD_DEFAULT_STREAM else None

            def hook() -> None:
                if called:
                    raise RuntimeError("hook: this receive hook was already called")
                if launching_thread is not None and threading.get_ident() != launching_thread:
                    raise RuntimeError(f"hook: the {call} ran on the per-thread default stream (2), which is "
                                       f"another stream in each thread; call hook() in the {call}'s thread, "
                                       f"or make the call on a stream of its own (stream=)")
                # Its launch would run on the freed workspace. Not refused for another hook's failed launch
                # (_steps_behind): counters are per parity and kind, and this one's are the other's; a
                # refusal would leave it pending, which update_ep_member refuses.
                self._check_alive("hook", launches=False)
                called.append(True)
                try:
                    self._receive(call, handle, receive)
                    # Launched: the stream orders any later use of that memory after it, where that stream
                    # is the arrays' own; elsewhere they are held until the receive half is done. A launch
                    # that failed leaves them with the hook: peers may still read x, and nothing here
                    # knows when they are done.
                    if arrays["held"] and not self._cuda.stream_is_capturing(stream_ptr):
                        self._hold_until_done(stream_ptr, arrays["held"])
                    arrays.clear()
                finally:
                    self._end_pending_hook(call, handle)
            # Dropped uncalled (the caller's code raised between the call and hook(), say), it would stay
            # pending for good: every later call on its parity, and update_ep_member, refuse that.
            weakref.finalize(hook, _drop_uncalled_hook, weakref.ref(self), call, handle, called)
            return EventOverlap(), hook
        if receive is not None:
            self._receive(call, handle, receive)
        elif call == "dispatch":  # both halves in one launch
            handle.state["received"] = True
        done = None
        if async_finish and like.device_type == "cuda":
            cuda = self._cuda
            done = cuda.record_event(cuda.comm_stream.ptr)
        if held and not capturing:
            self._hold_until_done(self._cuda.comm_stream.ptr if async_finish else stream_ptr, held, done)
        if done is not None:
            def wait() -> None:
                waiting = stream_ptr if stream_given else frameworks.get(like.framework).current_stream(like.device_id)
                cuda.stream_wait(waiting, done)
            return EventOverlap(wait, extra=tuple(view.keepalive for view in views)), None
        if views is not None:  # launched on the given stream: ordered there; the arrays live with the event
            return EventOverlap(extra=tuple(view.keepalive for view in views)), None
        return EventOverlap(), None

    def _end_pending_hook(self, call: str, handle: Handle) -> None:
        """A receive hook of ``call`` on ``handle`` is no longer pending (called, or dropped uncalled)."""
        if call == "dispatch":
            self._pending_hooks.discard(handle.parity)
        else:
            self._pending_combine_hooks[handle.parity] -= 1
            handle.state["combine_hook_pending"] = False

    def _hold_until_done(self, stream_ptr: int, keepalives: tuple, event=None) -> None:
        """Hold ``keepalives`` until the work queued on ``stream_ptr`` so far is done (``event``, one
        recorded there just now, or a new one). Not for a capturing stream (the callers check).

        For arrays of a call launched on another stream than their allocator's (async_finish, stream=,
        two frameworks): cupy's pool, say, hands a dropped array's memory to new work on the stream it
        was allocated on, which nothing orders after our kernels, and the returned event, which also
        holds them, is dropped by most callers. torch tensors are also recorded on the stream
        (_record_on), which orders the reuse of the memory torch's allocator made, not of memory it
        borrowed (torch.from_dlpack). Held arrays whose event is done are let go at the next call on a device
        (_let_go_of_done); destroy() lets go of all.
        """
        entry = (event if event is not None else self._cuda.record_event(stream_ptr), keepalives)
        with self._in_flight_lock:
            self._in_flight.append(entry)

    def _let_go_of_done(self) -> None:
        """Drop the held arrays (_hold_until_done) whose kernels are done, oldest first, up to the first
        not done; not while the call's stream captures a graph (the caller checks). Under a lock: a hook
        may run in another thread than the Buffer's calls."""
        cuda = self._cuda
        with self._in_flight_lock:
            in_flight = self._in_flight
            while in_flight and cuda.event_done(in_flight[0][0]):
                in_flight.popleft()

    def _record_on(self, async_finish: bool, stream_ptr: int, views: list[ArrayView]) -> None:
        """Record the call's torch tensors on the stream the kernels run on, the communication stream
        (async_finish: never torch's current one) or the given ``stream_ptr`` where it is not torch's
        current one, on which they were made: torch's allocator then keeps a dropped one's memory from
        new work until the kernels are done with it."""
        tensors = [view.obj for view in views if view.framework == "torch"]
        if not tensors:
            return
        torch_framework = frameworks.get("torch")
        cuda = self._cuda
        if async_finish:
            launch_stream = cuda.comm_stream.ptr
        elif not same_stream(torch_framework.current_stream(cuda.device_id), stream_ptr):
            launch_stream = stream_ptr
        else:
            return
        torch_framework.record_stream(tensors, launch_stream, cuda.device_id)

    def _receive(self, call: str, handle: Handle, receive) -> None:
        """Run a receive half (None: it ran with the send half), and mark the dispatch's handle:
        received, or failed (``"failed"``, or ``"combine_failed"`` for a combine's), which combine
        then refuses. On the GPU a failed receive half also leaves this rank's step counters behind
        (see :meth:`_check_alive`): every later launch is refused until update_ep_member."""
        try:
            if receive is not None:
                receive()
        except BaseException as error:
            reason = f"{type(error).__name__}: {error}"
            self._give_up_receive(call, handle, reason, f"the receive half of a {call} failed to launch ({reason})")
            raise
        if call == "dispatch":
            handle.state["received"] = True

    def _give_up_receive(self, call: str, handle: Handle, reason: str, steps_behind: str) -> None:
        """A receive half that will never run (it failed to launch, or its hook was dropped uncalled):
        the handle is marked (``reason``), which combine then refuses, and on the GPU, where the send
        half ran and moved the step counters, every later launch is refused until update_ep_member
        (``steps_behind`` says why)."""
        handle.state["failed" if call == "dispatch" else "combine_failed"] = reason
        if handle.backend == "cuda":  # a kernel's send half ran (host arrays run the reference)
            self._steps_behind = steps_behind

    def _allocate(self, plan: _Plan, like: ArrayView) -> list[tuple[ArrayView, Any]]:
        """The results of a call, allocated in the caller's framework on its device."""
        fw = frameworks.get(like.framework)
        results = []
        for (name, shape, dtype), strides, swapped in zip(plan.specs, plan.result_strides, plan.result_swapped):
            if swapped:
                obj = fw.empty_swapped(shape, strides, dtype, like.device_type, like.device_id)
            else:
                obj = fw.empty(shape, dtype, like.device_type, like.device_id)
            # An array just made dense with the spec's shape, layout and dtype: only its address is new,
            # so read_array's checks are skipped for torch and cupy (~1 us per result).
            if like.framework == "torch":
                view = ArrayView(obj, obj.data_ptr(), shape, strides, dtype, like.device_type, like.device_id,
                                 "torch", obj)
            elif like.framework == "cupy":
                # bf16 and fp8 arrive as cupy's raw-bits uint arrays, which read_array names by their uint dtype.
                view = ArrayView(obj, obj.data.ptr, shape, strides, fw.RAW_BITS_DTYPES.get(dtype, dtype),
                                 like.device_type, like.device_id, "cupy", obj)
            else:
                view = read_array(obj, name=name)
            results.append((view, obj))
        return results

    def _remember(self, key: tuple, plan: _Plan, like: ArrayView) -> None:
        """Keep a checked plan for calls whose arrays have the same layouts (device arrays only).

        Host arrays are not remembered: the reference path reads their values, which a layout does
        not decide. The cache is bounded: a caller cycling through many shapes only re-checks.
        """
        if like.device_type != "cuda":
            return
        if len(self._plans) >= _MAX_PLANS:
            self._plans.clear()
            self._disjoint_addresses.clear()  # keyed by the ids of the plans just dropped
            self._last_dispatch_plan = (None, None)
        self._plans[key] = plan

    def _check_active(self, where: str, view: ArrayView, like: ArrayView) -> None:
        check_array(where, "active_ranks", view, dtypes=("int32",), shape=(self.num_ranks,), like=like)
        # The call writes the ranks it masked into it, unless both it and the call's arrays are immutable.
        if view.framework not in IMMUTABLE_FRAMEWORKS or like.framework not in IMMUTABLE_FRAMEWORKS:
            check_writable(where, "active_ranks", view)

    def _check_size(self, where: str, num_max_tokens: int, hidden: int, num_experts: int) -> None:
        needed = layout.compute_layout(self.num_ranks, num_experts, num_max_tokens, hidden).num_bytes
        if needed > self.num_ep_buffer_bytes:
            raise ValueError(
                f"{where}: the buffer has {self.num_ep_buffer_bytes} bytes, this configuration (T={num_max_tokens}, "
                f"hidden={hidden}, num_experts={num_experts}, num_ranks={self.num_ranks}) needs {needed}: size it with "
                f"Buffer.get_ep_buffer_size_hint"
            )

    def _check_disjoint(self, where: str, plan: _Plan, addresses: tuple, names: tuple, views: list,
                        results_given: bool) -> None:
        """check_disjoint, and the arrays' alignment, for a call whose ``addresses`` (its plan's id,
        then its arrays' pointers) were not found good before; ``results_given``: the call has out=
        (its first view is out recv_x / combined_x). Remembered plans (device arrays) remember them
        too: callers that reuse their arrays, as graphs, static buffers and a caching allocator's
        inputs do, then pay one tuple lookup a call instead of the full check (~1-4 us). The plan's
        id stands for its sizes: a remembered plan lives until the plans are cleared, and these with
        it (_remember)."""
        check_disjoint(where, names[0], views, plan.span_nbytes, names[1])
        if results_given:
            check_vector_aligned(where, names[0][0], views[0], plan.span_nbytes[0])
        check_element_aligned(where, names[0], views, plan.span_nbytes)
        if views[0].device_type == "cuda":
            self._remember_checked(addresses)

    def _remember_checked(self, addresses: tuple) -> None:
        """Remember a call's addresses as checked (_disjoint_addresses), within its bound."""
        if len(self._disjoint_addresses) >= _MAX_DISJOINT_ADDRESSES:  # out= arrays that keep changing
            self._disjoint_addresses.clear()
        self._disjoint_addresses.add(addresses)

    def _check_same_routing(self, where: str, handle: Handle, topk_view: ArrayView) -> None:
        """Host arrays: combine's topk_idx against its dispatch's (validation.check_same_routing)."""
        dispatched = handle.state.get("topk_idx")
        if dispatched is not None:  # None: the dispatch ran on the GPU; its ids are not on the host
            check_same_routing(where, topk_view.numpy(), dispatched, handle.num_experts)

    def _check_handle(self, where: str, handle) -> None:
        self._check_handle_identity(where, handle)
        self._check_handle_state(where, handle)

    def _check_handle_identity(self, where: str, handle) -> None:
        """TypeError or ValueError unless ``handle`` is a Handle of this Buffer (an argument's mistake)."""
        if not isinstance(handle, Handle):
            # By module name: the JAX ops' Handle is a class of their own, above this module.
            advice = (" (a mooncake_ep.jax dispatch's: combine it with mooncake_ep.jax.combine)"
                      if type(handle).__module__.startswith("mooncake_ep.frameworks.jax") else "")
            raise TypeError(f"{where}: handle must be the Handle returned by Buffer.dispatch, got "
                            f"{type_name(handle)}{advice}")
        if handle.buffer_id != self.buffer_id:
            raise ValueError(f"{where}: handle was made by another Buffer")

    def _check_handle_state(self, where: str, handle: Handle) -> None:
        """ValueError or RuntimeError unless this Buffer's ``handle`` can be combined now: not stale, its
        dispatch received and no combine of it pending or through the workspace (this rank's state)."""
        if handle.dispatch_index < self._num_dispatches - layout.NUM_PARITIES:
            raise ValueError(f"{where}: handle is stale: dispatch #{handle.dispatch_index} was overwritten by the "
                             f"{self._num_dispatches - handle.dispatch_index - 1} dispatches after it")
        failed = handle.state.get("failed")
        if failed is not None:
            raise RuntimeError(f"{where}: the receive half of this handle's dispatch raised ({failed}); its results "
                               f"are undefined: dispatch again")
        if not handle.state["received"]:
            raise RuntimeError(f"{where}: the dispatch of this handle has not received yet: call its hook() first")
        failed = handle.state.get("combine_failed")
        if failed is not None:  # its send half ran: another combine would take the same step
            raise RuntimeError(f"{where}: the receive half of a combine of this handle raised ({failed}), after its "
                               f"send half ran: dispatch again")
        # One dispatch may be combined again only where the peers read nothing this rank rewrites: its
        # combine_x half is rewritten by a combine that copies into it and by the caller through
        # get_next_combine_buffer, and no combine waits for its readers there (the next dispatch on
        # the parity does). And two combines of one dispatch would take the same step.
        if handle.state.get("combine_hook_pending"):
            raise RuntimeError(f"{where}: a combine of this handle still waits for its hook(); call it first")
        how = handle.state.get("combined_through_workspace")
        if how:
            raise RuntimeError(f"{where}: this handle was already combined through the workspace ({how}), whose rows "
                               f"the peers may still be reading; dispatch again to combine again")


def _drop_uncalled_hook(buffer_ref, call: str, handle: Handle, called: list) -> None:
    """A receive hook collected without being called: no longer pending, its half given up as a
    receive that failed to launch is (:meth:`Buffer._give_up_receive`)."""
    buffer = buffer_ref()
    if called or buffer is None or buffer._destroyed:
        return
    buffer._end_pending_hook(call, handle)
    buffer._give_up_receive(call, handle, "its receive hook was dropped without being called",
                            f"the receive hook of a {call} was dropped without being called")


class _Plan(NamedTuple):
    """What a checked call needs, decided by its arrays' layouts and arguments (see Buffer._plans)."""

    num_tokens: int
    hidden: int
    num_topk: int
    specs: tuple  # (name, shape, dtype) of each result; shape a tuple
    # Strides of each result as the call makes it, in elements: worked out once per plan, not per
    # allocating call (~0.8 us a result). C-contiguous, or swapped_last_axes_strides where
    # result_swapped says so.
    result_strides: tuple
    result_swapped: tuple
    # The bytes of each array of the call, in check_disjoint's order (_DISPATCH_SPAN_NAMES).
    span_nbytes: tuple = ()

    @classmethod
    def of(cls, num_tokens: int, hidden: int, num_topk: int, specs, spans=(), swapped_last_axes=()) -> _Plan:
        """The plan of a call whose results are ``specs``, (name, shape, dtype) each; ``spans``: the
        call's arrays in check_disjoint's order; ``swapped_last_axes``: the names of the results made
        with their last two dimensions swapped (:func:`~mooncake_ep.tensor.swapped_last_axes_strides`)."""
        specs = tuple((name, tuple(shape), dtype) for name, shape, dtype in specs)
        swapped = tuple(name in swapped_last_axes for name, _, _ in specs)
        strides = tuple(swapped_last_axes_strides(shape) if swap else c_contiguous_strides(shape)
                        for (_, shape, _), swap in zip(specs, swapped))
        return cls(num_tokens, hidden, num_topk, specs, strides, swapped, tuple(view.nbytes for view in spans))


# Results accepted as out= with their last two dimensions swapped, and made so for torch callers: the
# fp8 scales, as DeepEP returns them (column-major [rows, columns] per local expert, what DeepGEMM's TMA
# loads read). numpy, cupy and JAX callers get them row-major: no GEMM of theirs wants the other
# layout, JAX arrays have no strides, and cupy 14.2's ndarray.get() of a non-contiguous array (so
# cupy.asnumpy of swapped scales) leaves the legacy default stream current (README, the fp8 scales).
_SWAPPED_RESULTS = ("recv_scales",)
_SWAPPING_FRAMEWORKS = ("torch",)


def _scale_strides(view: ArrayView) -> tuple[int, int]:
    """The row and column strides of recv_scales ``[E_l, rows, columns]`` (checked dense, row-major or
    swapped) for the kernel, in 4-byte elements; 0 for an extent of 1, whose stride any value may have."""
    _, rows, columns = view.shape
    row_stride, column_stride = view.strides[1:]
    return (row_stride if rows > 1 else 0), (column_stride if columns > 1 else 0)


# Checked plans a Buffer keeps; far more than the configurations an engine uses.
_MAX_PLANS = 256
# Address sets of out= calls a Buffer remembers as disjoint; more than the buffers an engine cycles.
_MAX_DISJOINT_ADDRESSES = 1024


def _workspace_bytes(where: str, num_max_tokens, hidden, num_ranks, num_experts) -> int:
    """Bytes of one rank's workspace for a configuration, its arguments checked in ``where``'s name."""
    num_max_tokens = check_int(where, "num_max_dispatch_tokens_per_rank", num_max_tokens, minimum=1)
    hidden = check_hidden(where, "hidden", hidden)
    num_ranks = check_int(where, "num_ranks", num_ranks, minimum=1, maximum=_constants.MAX_RANKS)
    num_experts = check_experts(where, num_experts, num_ranks)
    return layout.compute_layout(num_ranks, num_experts, num_max_tokens, hidden).num_bytes


def _signature(view: ArrayView) -> tuple:
    """Everything the layout checks read of an array: two arrays with equal signatures pass or fail alike."""
    return (view.shape, view.strides, view.dtype, view.device_type, view.device_id, view.framework, view.readonly,
            view.copied)


# Frameworks whose arrays read_array reads directly, ordering nothing: Buffer._wait_for_writers orders them.
_STREAM_FRAMEWORKS = ("torch", "cupy")
_NO_FRAMEWORKS: frozenset = frozenset()


def _launch_framework(view: ArrayView, given_stream: int | None) -> str | None:
    """The framework whose current stream the call launches on (``view``: the array that chose the
    stream), for _wait_for_writers; None where none is: a ``stream=`` given, or an array of another
    DLPack producer, whose stream is the legacy default one and whose allocator's is unknown (its
    arrays are then held until the kernels are done, as with ``stream=``)."""
    if given_stream is not None or view.framework == "dlpack":
        return None
    return view.framework


def _dlpack_stream(first: ArrayView, stream_ptr: int) -> int | None:
    """The stream to hand the producers of the call's other arrays: the launch stream (None for host arrays).

    CUDA producers other than torch and cupy make the launch stream wait for their pending writes
    through DLPack; torch and cupy arrays are read directly (Buffer._wait_for_writers orders them).
    """
    return None if first.device_type == "cpu" else stream_ptr


# The arrays of a call in check_disjoint's order and their names in errors: first those it writes (its
# out= arrays, then active_ranks, which the kernels update), then those it only reads. Dispatch's by
# (use_fp8, out= given), combine's by (zero_copy: no x, out= given).
def _span_names(out_names: tuple, read_names: tuple) -> tuple[tuple[str, ...], int]:
    return out_names + ("active_ranks",) + read_names, len(out_names) + 1


_DISPATCH_SPAN_NAMES = {
    (use_fp8, with_out): _span_names(
        (("out recv_x", "out recv_scales", "out recv_count") if use_fp8 else ("out recv_x", "out recv_count"))
        if with_out else (), ("x", "topk_idx"))
    for use_fp8 in (False, True) for with_out in (False, True)}
_COMBINE_SPAN_NAMES = {
    (zero_copy, with_out): _span_names(("out combined_x",) if with_out else (),
                                       ("topk_idx", "topk_weights") if zero_copy else ("x", "topk_idx", "topk_weights"))
    for zero_copy in (False, True) for with_out in (False, True)}


def _dispatch_spans(out_views, active_view, x_view, topk_view) -> list:
    """A dispatch's arrays in the order of _DISPATCH_SPAN_NAMES (out_views None: no out=)."""
    views = [] if out_views is None else [view for view, _ in out_views]
    views += active_view, x_view, topk_view
    return views


def _combine_spans(combined_view, active_view, x_view, topk_view, weights_view) -> list:
    """A combine's arrays in the order of _COMBINE_SPAN_NAMES (combined_view None: no out=)."""
    views = [] if combined_view is None else [combined_view]
    views.append(active_view)
    if x_view is not None:
        views.append(x_view)
    views += topk_view, weights_view
    return views


def _torch_records_gradients() -> bool:
    """torch.is_grad_enabled(), or False while torch was never imported."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled()


def _torch_outputs(where: str, out_views, names: tuple[str, ...]) -> list:
    """The torch tensors among a call's out= arrays (``names`` theirs, in order), which it writes in place.

    The call counts its write in their version counters (frameworks.torch.mark_modified) in every
    grad mode, as torch's own out= ops do: a tensor an earlier graph saved and a call under
    ``no_grad`` / ``inference_mode`` overwrote (an engine's static buffers, reused between a training
    step and an eval step) makes that graph's backward raise, not compute from the new values. While
    torch records gradients, one that requires grad is refused, as torch's out= ops refuse it: the
    write has no gradient. Empty without out=. active_ranks is not counted: the kernels write it
    only when a rank times out, and a count every call would fail every backward that read the mask.
    """
    if out_views is None:
        return []
    tensors = [tensor for view, tensor in out_views if view.framework == "torch"]
    if tensors and _torch_records_gradients():
        for tensor in tensors:
            if tensor.requires_grad:
                name = next(name for (_, out), name in zip(out_views, names) if out is tensor)
                raise ValueError(f"{where}: {name} requires grad, and the call writes into it with no gradient "
                                 f"(torch's out= ops refuse it too); pass a tensor that does not require grad")
    return tensors


def _timeout_ns(timeout_us: int) -> int:
    return -1 if timeout_us < 0 else int(timeout_us) * 1000


def _caller_arrays(outputs, like: ArrayView) -> list:
    """The results as the caller's framework holds them (immutable frameworks get them built now)."""
    if like.framework not in IMMUTABLE_FRAMEWORKS:
        return [obj for _, obj in outputs]
    fw = frameworks.get(like.framework)
    return [fw.from_numpy(view.numpy(), like) for view, _ in outputs]


def _with_receivers_mask(gathered: list[tuple], rank: int, active_view: ArrayView) -> list[tuple]:
    """The exchanged arrays (every rank's, its active_ranks last) with this rank's mask as its receive
    half reads it: now, as the kernels read the caller's array when that half runs (a hook, later).
    Its send half skipped the ranks the mask of the call marked, itself included, so its entry for
    itself stays 0 if it was 0 then."""
    sent = gathered[rank][-1]
    now = np.array(active_view.numpy(), dtype=np.int32, copy=True)
    now[rank] = now[rank] if sent[rank] else 0
    return [*gathered[:rank], (*gathered[rank][:-1], now), *gathered[rank + 1:]]


def _write_mask(view: ArrayView, mask: np.ndarray) -> None:
    """Mark in the caller's active_ranks the ranks the call masked.

    Only zeros are written, as the kernels do: ``mask`` starts from the array as it was at the call,
    and a receive half that runs later (a hook) must not bring back a rank masked meanwhile.

    Note:
        An immutable (JAX) array is never written, even when its memory is reachable: the caller
        keeps the mask it passed.
    """
    if view.framework in IMMUTABLE_FRAMEWORKS:
        return
    array = view.numpy()
    if array.flags.writeable:
        array[mask == 0] = 0
