"""The symmetric workspace: device memory from our own ``cudaMalloc``.

Our own allocation (not a framework's pool) so that legacy CUDA IPC can export it and its address
never moves; zeroed once, because every epoch starts from zero.
"""

from __future__ import annotations

import logging
import weakref

logger = logging.getLogger("mooncake_ep")


def _settle_legacy_stream() -> None:
    """Wait until memset/memcpy issued on the legacy default stream have landed.

    They return before the device has done them, and the kernels run on non-blocking streams that
    are not ordered after the legacy stream: a kernel (or a peer's flag write) could otherwise see
    the workspace before it is zeroed or a layout before it is written. Only the legacy stream is
    waited for, never the whole device, where peers' kernels may be waiting for this rank.
    """
    import cupy

    cupy.cuda.runtime.streamSynchronize(0)


class TransportError(RuntimeError):
    """A workspace could not be allocated, mapped or reached."""


def raise_if_any_failed(group, what: str, failure: str) -> None:
    """Collective: every rank says whether its part of a connection failed (``failure``, empty if
    not); if any did, every rank raises TransportError naming each failing rank's reason. A rank
    that failed alone would otherwise leave the others waiting at a barrier it never reaches, or
    connected to workspaces it then frees."""
    failures = {rank: blob.decode() for rank, blob in enumerate(group.allgather_bytes(failure.encode())) if blob}
    if failures:
        raise TransportError(f"{what}: " + "; ".join(f"on rank {rank}: {message}"
                                                      for rank, message in failures.items()))


def failure_text(exc: BaseException) -> str:
    """What a rank tells the others of its failed part of a connection (:func:`raise_if_any_failed`): a
    TransportError's own message, which names the ranks; any other error (a CUDA runtime error) with its type."""
    return str(exc) if isinstance(exc, TransportError) else f"{type(exc).__name__}: {exc}"


def _free_device_memory(device_id: int, ptr: int) -> None:
    """cudaFree on ``device_id`` (a finalizer: it never raises)."""
    try:
        import cupy

        with cupy.cuda.Device(device_id):
            cupy.cuda.runtime.free(ptr)
    except Exception as exc:  # noqa: BLE001 - a finalizer may not raise; the process keeps going
        logger.warning("mooncake_ep: freeing a %#x workspace on cuda:%d failed: %s", ptr, device_id, exc)


class DeviceWorkspace:
    """``num_bytes`` of zeroed device memory on ``device_id``, freed by :meth:`free`.

    Args:
        num_bytes: size of the allocation.
        device_id: the CUDA device.
        host_mirror: also pin ``num_bytes`` of host memory, for :meth:`write_on_stream`.

    Note:
        A workspace dropped without :meth:`free` is freed when it is garbage-collected (not at
        interpreter exit, when the process's CUDA context goes anyway). Exported memory must not
        be freed while another process still maps it: the transports decide when that is.
    """

    def __init__(self, num_bytes: int, device_id: int, *, host_mirror: bool = False):
        import cupy

        self.num_bytes = int(num_bytes)
        self.device_id = int(device_id)
        # Pinned host memory for write_on_stream, allocated now: page-locking synchronises the device.
        self._mirror = cupy.cuda.alloc_pinned_memory(self.num_bytes) if host_mirror else None
        with cupy.cuda.Device(self.device_id):
            try:
                self.ptr = int(cupy.cuda.runtime.malloc(self.num_bytes))
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise TransportError(
                    f"cudaMalloc of a {self.num_bytes}-byte workspace on cuda:{self.device_id} failed: {exc}"
                ) from exc
            self._finalizer = weakref.finalize(self, _free_device_memory, self.device_id, self.ptr)
            self._finalizer.atexit = False
            cupy.cuda.runtime.memset(self.ptr, 0, self.num_bytes)
            _settle_legacy_stream()

    def write(self, offset: int, data: bytes) -> None:
        """Copy host bytes to ``ptr + offset`` (synchronously: only at construction or reconfiguration)."""
        import ctypes

        import cupy

        buffer = ctypes.create_string_buffer(data, len(data))
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.memcpy(self.ptr + offset, ctypes.addressof(buffer), len(data),
                                     cupy.cuda.runtime.memcpyHostToDevice)
            _settle_legacy_stream()

    def write_on_stream(self, offset: int, data: bytes, stream_ptr: int) -> None:
        """Copy host bytes to ``ptr + offset`` in the order of ``stream_ptr`` (cudaMemcpyAsync).

        For writes inside a call: the host never waits, where a synchronous copy, or a pinned
        allocation, can wait behind kernels of in-process peers that wait for this very rank. The
        bytes go through the pinned mirror allocated at construction (``host_mirror=True``); keep
        the bytes at an offset unchanged once written, as a CUDA graph may have recorded the copy.

        Raises:
            RuntimeError: the workspace was built without a host mirror.
        """
        import ctypes

        import cupy

        if self._mirror is None:
            raise RuntimeError("DeviceWorkspace.write_on_stream needs a workspace built with host_mirror=True")
        ctypes.memmove(self._mirror.ptr + offset, data, len(data))
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.memcpyAsync(self.ptr + offset, self._mirror.ptr + offset, len(data),
                                          cupy.cuda.runtime.memcpyHostToDevice, stream_ptr)

    def read(self, offset: int, num_bytes: int) -> bytes:
        """Copy ``num_bytes`` at ``ptr + offset`` to the host (synchronously; for tests and tools)."""
        import ctypes

        import cupy

        buffer = ctypes.create_string_buffer(num_bytes)
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.runtime.memcpy(ctypes.addressof(buffer), self.ptr + offset, num_bytes,
                                     cupy.cuda.runtime.memcpyDeviceToHost)
        return buffer.raw

    def peek(self, offset: int, num_bytes: int) -> bytes:
        """Copy ``num_bytes`` at ``ptr + offset`` to the host without a device-wide sync.

        cudaMemcpy on the legacy stream, which orders nothing on the non-blocking rank streams:
        the caller makes sure no kernel writes those bytes meanwhile. (:meth:`read` synchronises
        the device first, which in one process also waits for the other ranks' kernels.)
        """
        import ctypes

        import cupy

        buffer = ctypes.create_string_buffer(num_bytes)
        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.memcpy(ctypes.addressof(buffer), self.ptr + offset, num_bytes,
                                     cupy.cuda.runtime.memcpyDeviceToHost)
        return buffer.raw

    def abandon(self) -> None:
        """Never free this memory (until the process ends): garbage collection will not either.

        For the owner that cannot know when freeing is safe: freeing synchronises the device, and
        collection runs on whichever thread allocates next, which in one process may be a rank
        whose peers' kernels are waiting for it.
        """
        self._finalizer.detach()

    def synchronize(self) -> None:
        """Wait for this process's work on the workspace's device (only this process's: peers may be
        in others)."""
        import cupy

        with cupy.cuda.Device(self.device_id):
            cupy.cuda.runtime.deviceSynchronize()

    def free(self) -> None:
        """Wait for this process's work on the device, then free the memory. Idempotent.

        A failed wait (a kernel faulted: the context is gone) raises and frees nothing: the
        finalizer still owns the memory, and a later ``free`` tries again.
        """
        if self.ptr:
            import cupy

            self.synchronize()
            with cupy.cuda.Device(self.device_id):
                self._finalizer.detach()
                ptr, self.ptr = self.ptr, 0  # a failed cudaFree is not retried: the memory is lost either way
                cupy.cuda.runtime.free(ptr)
