"""The DLPack boundary: read any caller's array as an :class:`ArrayView`, export our memory back.

Every array that enters ``mooncake_ep`` (torch, JAX, cupy, numpy or any other DLPack producer)
is read once into an :class:`ArrayView`: data pointer, shape, strides, dtype name and device.
Kernels see only that. Memory we own (workspace regions, host buffers) leaves as a
:class:`DeviceMemoryArray`, which any framework imports with its ``from_dlpack``.

Example::

    view = read_array(x, name="dispatch: x", stream=stream_ptr)
    if view.dtype != "bfloat16":
        raise TypeError(f"dispatch: x must be bfloat16, got {view.dtype}")
    launch(view.ptr, ...)

The capsule reader is our own (ctypes over the structs of ``dlpack.h``, in
:mod:`mooncake_ep._dlpack`), so no framework is imported here: torch is imported only when a
torch tensor arrives, for its fast path.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from mooncake_ep import _dlpack

# ABI facts, defined in _dlpack and part of this module's surface: DLPACK_VERSION,
# MIN_DLPACK_VERSION and the enums are in __all__; tests and callers also reach the structs here.
from mooncake_ep._dlpack import (  # noqa: F401  (re-exported)
    DLPACK_FLAG_BITMASK_IS_COPIED,
    DLPACK_FLAG_BITMASK_READ_ONLY,
    DLPACK_VERSION,
    MIN_DLPACK_VERSION,
    DLDataType,
    DLDataTypeCode,
    DLDevice,
    DLDeviceType,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLPackVersion,
    DLTensor,
)

__all__ = [
    "DLPACK_VERSION",
    "MIN_DLPACK_VERSION",
    "DLDeviceType",
    "DLDataTypeCode",
    "DLPACK_DEVICE_TYPES",
    "DLPACK_DTYPES",
    "DTYPES",
    "ArrayView",
    "DeviceMemoryArray",
    "read_array",
    "c_contiguous_strides",
    "swapped_last_axes_strides",
    "masked_array_error",
    "numpy_dtype",
]

# DLPack device type -> our device_type. Pinned host memory is host memory: numpy can view it,
# and producers route it through their CPU exporter (which refuses a stream). Managed memory is
# addressed by kernels on its device_id, so it reads as "cuda".
DLPACK_DEVICE_TYPES: dict[int, str] = {
    DLDeviceType.kDLCPU: "cpu",
    DLDeviceType.kDLCUDA: "cuda",
    DLDeviceType.kDLCUDAHost: "cpu",
    DLDeviceType.kDLCUDAManaged: "cuda",
}

# (DLPack type code, bits) -> our dtype name; lanes must be 1.
DLPACK_DTYPES: dict[tuple[int, int], str] = {
    (DLDataTypeCode.kDLBfloat, 16): "bfloat16",
    (DLDataTypeCode.kDLFloat8_e4m3fn, 8): "float8_e4m3fn",
    (DLDataTypeCode.kDLFloat, 16): "float16",
    (DLDataTypeCode.kDLFloat, 32): "float32",
    (DLDataTypeCode.kDLFloat, 64): "float64",
    (DLDataTypeCode.kDLInt, 8): "int8",
    (DLDataTypeCode.kDLInt, 32): "int32",
    (DLDataTypeCode.kDLInt, 64): "int64",
    (DLDataTypeCode.kDLUInt, 8): "uint8",
    # cupy has no bf16: frameworks.cupy carries bf16 as uint16 raw bits, so those must read back.
    (DLDataTypeCode.kDLUInt, 16): "uint16",
    (DLDataTypeCode.kDLBool, 8): "bool",
}
_DTYPE_TO_DLPACK = {name: code_bits for code_bits, name in DLPACK_DTYPES.items()}
# Every dtype name an ArrayView or DeviceMemoryArray can carry.
DTYPES: tuple[str, ...] = tuple(DLPACK_DTYPES.values())

_NUMPY_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    **{n: np.dtype(n) for n in ("float16", "float32", "float64", "int8", "int32", "int64",
                                "uint8", "uint16", "bool")},
}
_NUMPY_TO_NAME = {dt: name for name, dt in _NUMPY_DTYPES.items()}


def numpy_dtype(dtype: str) -> np.dtype:
    """Returns the numpy dtype of a dtype name (bf16 and fp8 as ``ml_dtypes`` types).

    Raises:
        TypeError: ``dtype`` is not one of :data:`DTYPES`.
    """
    try:
        return _NUMPY_DTYPES[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"dtype must be one of {DTYPES}, got {dtype!r}") from None


def c_contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Returns the strides, in elements, of a C-contiguous (row-major) array of ``shape``."""
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(int(extent), 1)
    return tuple(reversed(strides))


def swapped_last_axes_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Returns the strides, in elements, of a C-contiguous array of ``shape`` with its last two
    extents swapped, viewed with those two dimensions swapped back: DeepEP's fp8 scales
    ``[E_l, rows, columns]``, column-major in their last two dimensions (the layout TMA reads)."""
    *outer, rows, columns = shape
    *outer_strides, column_stride, row_stride = c_contiguous_strides((*outer, columns, rows))
    return (*outer_strides, row_stride, column_stride)


# ---------------------------------------------------------------------------------------------
# ArrayView


class _NumpyInterface:
    """Hands memory to numpy through ``__array_interface__``; numpy keeps it as the base."""

    __slots__ = ("__array_interface__", "_keepalive")

    def __init__(self, interface: dict, keepalive: object) -> None:
        self.__array_interface__ = interface
        self._keepalive = keepalive


def _numpy_over(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str,
                readonly: bool, keepalive: object, raw_bits: bool = False) -> np.ndarray:
    """A zero-copy numpy array over host memory whose base keeps ``keepalive`` alive.

    With ``raw_bits`` the elements are unsigned ints of the same width (numpy never reads them).
    """
    np_dtype = _NUMPY_DTYPES[dtype]
    # numpy's interface knows no bf16/fp8: describe the bits as unsigned ints, then view.
    raw = np.dtype(f"u{np_dtype.itemsize}")
    interface = {
        "version": 3,
        "shape": tuple(shape),
        "typestr": raw.str,
        "data": (ptr, readonly),
        "strides": tuple(s * np_dtype.itemsize for s in strides),
    }
    array = np.asarray(_NumpyInterface(interface, keepalive))
    return array if raw_bits else array.view(np_dtype)


class ArrayView:
    """One caller array as the kernels see it. Made by :func:`read_array`; never copies.

    Attributes:
        obj: the caller's object, returned untouched.
        ptr: address of element ``[0, ..., 0]`` (DLPack ``data + byte_offset``); a device
            address when ``device_type == "cuda"``. May be 0 for an empty array.
        shape: extents, one per dimension; ``()`` for a 0-d array.
        strides: steps between neighbours of each dimension, in elements (not bytes); may be
            negative (numpy) or 0 (broadcast).
        dtype: one of :data:`DTYPES` (``"bfloat16"``, ``"float8_e4m3fn"``, ``"int64"``, ...).
        device_type: ``"cpu"`` (including pinned ``kDLCUDAHost`` memory) or ``"cuda"``
            (including ``kDLCUDAManaged`` memory).
        device_id: CUDA ordinal for ``"cuda"``; 0 for ``"cpu"``.
        framework: producer, from ``type(obj).__module__``: ``"numpy"``, ``"torch"``,
            ``"jax"``, ``"cupy"``, or ``"dlpack"`` for any other producer.
        keepalive: what keeps the memory valid while the view lives: the caller's array, or
            the owner of a consumed capsule, whose deleter runs when it is collected.
        readonly: the memory must not be written: the producer marked it read-only (DLPack >= 1.0
            flag, or a numpy array that is not writeable), or it is a JAX array's (:attr:`jax_memory`).
            Other legacy capsules cannot say so and read ``False``.
        copied: the producer exported a copy of its array (the DLPack >= 1.0 ``IS_COPIED``
            flag): what the library reads is right, what it writes never reaches the caller.
        jax_memory: the memory is a JAX array's, read from a legacy capsule JAX made (a JAX array,
            or a capsule or wrapper of one): JAX assumes it never changes, and such a capsule has no
            READ_ONLY flag to say so, so ``readonly`` is True too; this names the cause in errors.

    Note:
        The memory is valid only while this view (or ``obj``) is alive; keep the view, not a
        bare ``ptr``, until the kernel that reads it has finished. A view is a value: nothing
        assigns to its attributes after construction. (It is a plain class with ``__slots__``
        rather than a frozen dataclass because every call reads several arrays, and a frozen
        dataclass costs a microsecond more to build each time.)
    """

    __slots__ = ("obj", "ptr", "shape", "strides", "dtype", "device_type", "device_id", "framework", "keepalive",
                 "readonly", "copied", "jax_memory")

    def __init__(self, obj: Any, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: str,
                 device_type: str, device_id: int, framework: str, keepalive: Any, readonly: bool = False,
                 copied: bool = False, jax_memory: bool = False) -> None:
        self.obj = obj
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device_type = device_type
        self.device_id = device_id
        self.framework = framework
        self.keepalive = keepalive
        self.readonly = readonly
        self.copied = copied
        self.jax_memory = jax_memory

    def __repr__(self) -> str:
        return (f"ArrayView(ptr={self.ptr:#x}, shape={self.shape}, strides={self.strides}, dtype={self.dtype}, "
                f"device={self.device_type}:{self.device_id}, framework={self.framework}, readonly={self.readonly})")

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _NUMPY_DTYPES[self.dtype].itemsize

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (``size * itemsize``), not of the strided span."""
        return self.size * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        """Whether the elements are dense in C (row-major) order.

        Dimensions of extent 1 may have any stride, and an empty array is contiguous.
        """
        if self.size == 0:
            return True
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True

    @property
    def is_swapped_last_axes(self) -> bool:
        """Whether the elements are dense in the order of :func:`swapped_last_axes_strides`
        (DeepEP's fp8 scales). Dimensions of extent 1 may have any stride, as in :attr:`is_contiguous`."""
        if self.size == 0:
            return True
        expected = swapped_last_axes_strides(self.shape)
        return all(extent == 1 or stride == want for extent, stride, want in zip(self.shape, self.strides, expected))

    def numpy(self) -> np.ndarray:
        """Returns a zero-copy numpy array over the memory (CPU only).

        bf16 and fp8 come as ``ml_dtypes.bfloat16`` / ``ml_dtypes.float8_e4m3fn``. The array
        keeps this view's ``keepalive`` alive, and is read-only when the view is.

        Raises:
            TypeError: the memory is on a CUDA device.
        """
        if self.device_type != "cpu":
            raise TypeError(
                f"ArrayView.numpy: only CPU memory can be viewed by numpy, this array is on "
                f"{self.device_type}:{self.device_id}; copy it to the host in its framework")
        if self.size == 0:
            array = np.empty(self.shape, _NUMPY_DTYPES[self.dtype])
            array.flags.writeable = not self.readonly
            return array
        return _numpy_over(self.ptr, self.shape, self.strides, self.dtype, self.readonly, self)


# ---------------------------------------------------------------------------------------------
# read_array

_FRAMEWORK_OF_MODULE = {"numpy": "numpy", "torch": "torch", "jax": "jax", "jaxlib": "jax",
                        "cupy": "cupy", "cupy_backends": "cupy"}


def _framework_of(obj: object) -> str:
    root = type(obj).__module__.partition(".")[0]
    return _FRAMEWORK_OF_MODULE.get(root, "dlpack")


def _dtype_from_dlpack(code: int, bits: int, lanes: int, name: str) -> str:
    dtype = DLPACK_DTYPES.get((code, bits)) if lanes == 1 else None
    if dtype is None:
        raise _unknown_dtype(name, f"DLPack dtype code={code} bits={bits} lanes={lanes}")
    return dtype


def _unknown_dtype(name: str, got: str) -> TypeError:
    """The error for an array of a dtype no argument takes (each argument's own dtypes are checked later)."""
    return TypeError(f"{name} has a dtype no argument of mooncake_ep takes: {got}; the library reads {DTYPES} in "
                     f"native byte order, and this argument's dtypes are in the call's docstring")


def _device_from_dlpack(device_type: int, device_id: int, name: str) -> tuple[str, int]:
    ours = DLPACK_DEVICE_TYPES.get(device_type)
    if ours is None:
        kind = _dlpack.DEVICE_TYPE_NAMES.get(int(device_type), "unknown")
        raise TypeError(f"{name} must be on a CPU or CUDA device, got DLPack device type "
                        f"{int(device_type)} ({kind})")
    return ours, (int(device_id) if ours == "cuda" else 0)


def _read_numpy(obj: np.ndarray, name: str, stream: int | None = None) -> ArrayView:
    # No DLPack: numpy refuses to export ml_dtypes (bf16/fp8) and read-only arrays through it.
    # `stream` is the readers' common signature (see _reader_of); host memory orders nothing.
    dtype = _NUMPY_TO_NAME.get(obj.dtype) if obj.dtype.isnative else None
    if dtype is None:
        raise _unknown_dtype(name, f"numpy dtype {obj.dtype.str} ({obj.dtype})")
    return ArrayView(obj=obj, ptr=obj.__array_interface__["data"][0], shape=obj.shape,
                     strides=_element_strides(obj.strides, obj.dtype.itemsize, name), dtype=dtype,
                     device_type="cpu", device_id=0, framework="numpy", keepalive=obj,
                     readonly=not obj.flags.writeable)


_torch_dtypes: dict[Any, str] = {}
# Real dtypes a public torch API can hand out with the negative bit set: the imaginary part of a
# conjugated complex tensor. (Checking the bit of every array would cost ~0.1 us each.)
_TORCH_LAZY_NEGATION_DTYPES = frozenset(("float16", "float32", "float64"))
_torch_module: list[Any] = []  # torch, once a tensor has been seen (imported lazily, then cached)
_torch_stream: list[Any] = []  # its current-stream getter, cached with it


def same_stream(current: int, stream: int) -> bool:
    """Whether two ``cudaStream_t`` handles name one stream (0 and 1 both name the legacy default)."""
    return (current or 1) == (stream or 1)


def _torch():
    if not _torch_module:
        import torch

        # Of the dtypes this torch has: uint16 came in torch 2.3, and a tensor of a dtype torch lacks
        # cannot be made.
        _torch_dtypes.update({getattr(torch, n): n for n in DTYPES if hasattr(torch, n)})
        # The raw handle without building a torch.cuda.Stream (microseconds, once per array of
        # a call); the public spelling where a build lacks it.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            def raw(device_id: int) -> int:
                return torch.cuda.current_stream(device_id).cuda_stream
        _torch_stream.append(raw)
        _torch_module.append(torch)  # last: a thread that sees torch finds the rest set too
    return _torch_module[0]


def torch_current_stream(device_id: int) -> int:
    """torch's current CUDA stream handle on ``device_id`` (0 = legacy default)."""
    if not _torch_stream:  # every call of dispatch/combine asks: _torch() only until it has run
        _torch()
    return _torch_stream[0](device_id)


def _read_torch(obj: Any, name: str, stream: int | None) -> ArrayView:
    """Fast path: pointer and layout straight from the tensor, whatever ``stream`` (see read_array's note).

    Reached only for subclasses of torch.Tensor (see :func:`_reader_of`), so torch is loaded.
    """
    dtype = _torch_dtypes.get(obj.dtype)
    if obj.layout is not _torch_module[0].strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {obj.layout}")
    if dtype is None:
        raise _unknown_dtype(name, str(obj.dtype))
    if dtype in _TORCH_LAZY_NEGATION_DTYPES and obj.is_neg():
        # Checked before the DLPack fallback too: torch exports such a tensor's memory as it is.
        raise TypeError(f"{name} is a lazily negated view (torch's negative bit, e.g. from .conj().imag): its "
                        f"memory holds the negated values; pass .resolve_neg()")
    if obj.is_cuda:
        device_id = obj.get_device()
        device_type = "cuda"
    elif obj.device.type == "cpu":
        device_type, device_id = "cpu", 0
    else:
        raise TypeError(f"{name} must be on a CPU or CUDA device, got torch device {obj.device}")
    try:
        ptr = obj.data_ptr()
        shape = obj.shape  # torch.Size: a tuple already
        strides = obj.stride()
    except RuntimeError as error:  # torch's, for tensors without plain strided memory (nested, vmapped)
        raise TypeError(f"{name}: this {type(obj).__qualname__} cannot be read as a strided array in memory "
                        f"({error})") from error
    if not ptr and obj.numel():
        raise TypeError(f"{name} has no memory (data_ptr() is 0): a fake tensor, as torch.compile traces with; "
                        f"call mooncake_ep on real tensors (outside the traced region)")
    return ArrayView(obj, ptr, shape, strides, dtype, device_type, device_id, "torch", obj)


def _element_strides(byte_strides: tuple[int, ...], itemsize: int, name: str) -> tuple[int, ...]:
    """Strides in elements of an array whose strides are in bytes (cupy's), remembered per layout."""
    key = (byte_strides, itemsize)
    strides = _ELEMENT_STRIDES.get(key)
    if strides is None:
        if any(s % itemsize for s in byte_strides):
            raise ValueError(f"{name} must have strides that are multiples of its itemsize "
                             f"({itemsize}), got {byte_strides} bytes")
        strides = tuple(s // itemsize for s in byte_strides)
        if len(_ELEMENT_STRIDES) >= _MAX_ELEMENT_STRIDES:
            _ELEMENT_STRIDES.clear()
        _ELEMENT_STRIDES[key] = strides
    return strides


# (byte strides, itemsize) -> element strides: a call's arrays have a few layouts, seen again and again.
_ELEMENT_STRIDES: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
_MAX_ELEMENT_STRIDES = 1024


def _read_cupy(obj: Any, name: str, stream: int | None) -> ArrayView:
    """Fast path: pointer and layout straight from a cupy array, whatever ``stream`` (see read_array's note).

    cupy's ``__dlpack__`` would record and wait on an event per export (~20 us).
    Reached only for subclasses of cupy.ndarray (see :func:`_reader_of`), so cupy is loaded.
    """
    dtype = _NUMPY_TO_NAME.get(obj.dtype)  # a byte-swapped dtype is not equal to any of ours
    if dtype is None:
        raise _unknown_dtype(name, f"cupy dtype {obj.dtype.str} ({obj.dtype})")
    memory = obj.data
    return ArrayView(obj, memory.ptr, obj.shape, _element_strides(obj.strides, obj.itemsize, name), dtype, "cuda",
                     memory.device_id, "cupy", obj)


def _view_from_capsule(capsule: Any, obj: Any, name: str, framework: str) -> ArrayView:
    """Reads a DLPack capsule and consumes it; the returned view owns the managed tensor."""
    opened = _dlpack.open_capsule(capsule, name)
    dtype = _dtype_from_dlpack(opened.code, opened.bits, opened.lanes, name)
    device_type, device_id = _device_from_dlpack(opened.device_type, opened.device_id, name)
    shape = opened.shape
    # NULL strides: compact row-major
    strides = opened.strides if opened.strides is not None else c_contiguous_strides(shape)
    if not opened.ptr and math.prod(shape):  # as torch's reader refuses: a kernel would fault on address 0
        raise TypeError(f"{name} has no memory (its DLPack data pointer is NULL): a fake or meta tensor's export; "
                        f"pass an array with memory")
    # Checked before consuming: a refused capsule stays with its producer's destructor.
    owner = _dlpack.consume_capsule(capsule, opened, name)
    # A JAX capsule's readonly (opened.readonly is set) keeps it from out= and active_ranks even where a
    # remembered plan skips the checks: the plans' keys hold readonly, not jax_memory.
    return ArrayView(obj=obj, ptr=opened.ptr, shape=shape, strides=strides, dtype=dtype,
                     device_type=device_type, device_id=device_id, framework=framework,
                     keepalive=owner, readonly=opened.readonly, copied=opened.copied,
                     jax_memory=opened.made_by_jax)


def dense_device_view(obj: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype, device_id: int, *, name: str,
                      framework: str, readonly: bool) -> ArrayView:
    """A view of CUDA memory its producer describes as dense and row-major, without DLPack.

    For producers whose arrays cannot be laid out otherwise, such as the buffers XLA hands a
    ``buffer_callback``: their ``__dlpack__`` makes a capsule that :func:`read_array` would open,
    read field by field and consume, ~10 us an array, where the producer's own attributes cost ~1.

    Args:
        obj: the producer's object; the view keeps it alive.
        ptr: the address of element ``[0, ..., 0]`` on ``cuda:device_id``.
        dtype: the numpy dtype of the elements (``ml_dtypes``' for bf16 and fp8).
        name: for the error message.

    Raises:
        TypeError: ``dtype`` is not one of :data:`DTYPES`.
    """
    dtype_name = _NUMPY_TO_NAME.get(dtype)
    if dtype_name is None:
        raise _unknown_dtype(name, f"numpy dtype {dtype}")
    shape = tuple(shape)
    return ArrayView(obj, ptr, shape, c_contiguous_strides(shape), dtype_name, "cuda", device_id, framework, obj,
                     readonly=readonly)


def read_array(obj: Any, *, name: str, stream: int | None = None) -> ArrayView:
    """Reads any array (numpy, torch, JAX, cupy, any DLPack producer) without copying.

    Args:
        obj: the array. numpy arrays, torch tensors and cupy arrays are read directly; anything else through
            ``obj.__dlpack__`` (a bare DLPack capsule is accepted and consumed too). A legacy capsule made by
            JAX reads as read-only: JAX arrays are immutable, and such a capsule has no flag to say so.
        name: call and argument for error messages, e.g. ``"dispatch: x"``.
        stream: the CUDA stream (``cudaStream_t`` as an int) the caller will launch on; 0 is the
            legacy default stream (passed to DLPack as 1), 2 the per-thread default, -1 asks
            for no ordering. A CUDA producer read through DLPack makes this stream wait for its
            pending writes. ``None``: no stream is passed (DLPack then assumes the legacy default).

    Returns:
        An :class:`ArrayView`; its memory stays valid while the view lives.

    Raises:
        TypeError: ``obj`` has no ``__dlpack__``, or its dtype is not one of :data:`DTYPES`, or
            it is on neither a CPU nor a CUDA device, or its producer refused the export.
        ValueError: ``stream`` is not an int >= -1.

    Note:
        torch tensors and cupy arrays are always read directly, and that orders nothing: a caller
        launching on another stream than their framework's current one makes its stream wait for
        that one itself (:meth:`mooncake_ep.Buffer` does, once per framework and call). Exporting
        them through DLPack instead would cost an event per array, and torch refuses to export
        tensors that require grad, tensors of another device than its current one, and stream 2.
    """
    if stream is not None and (not isinstance(stream, int) or stream < -1):
        raise ValueError(f"{name}: stream must be None or a CUDA stream handle (int >= -1), "
                         f"got {stream!r}")
    kind = type(obj)
    reader = _READERS.get(kind)
    if reader is None:
        if len(_READERS) >= _MAX_READERS:  # types made on the fly must not pile up
            _READERS.clear()
        reader = _READERS[kind] = _reader_of(kind)
    view = reader(obj, name, stream)
    if view is not None:
        return view
    if _dlpack.is_capsule(obj):
        return _view_from_capsule(obj, obj, name, "dlpack")
    capsule = _dlpack.request_capsule(obj, name, stream)
    return _view_from_capsule(capsule, obj, name, _FRAMEWORK_OF_READER.get(reader) or _framework_of(obj))


def _no_fast_path(obj: Any, name: str, stream: int | None) -> None:
    return None


def _reader_of(kind: type) -> Callable[[Any, str, int | None], ArrayView | None]:
    """The fast-path reader of arrays of type ``kind`` (it may still answer None: use DLPack).

    Subclasses count wherever they are defined: a tensor of a type of its own is still a torch
    tensor, whose results are torch tensors. A framework not imported yet has no arrays.
    """
    if issubclass(kind, np.ma.MaskedArray):
        return _refuse_masked
    if issubclass(kind, np.ndarray):
        return _read_numpy
    torch = sys.modules.get("torch")
    if torch is not None and issubclass(kind, torch.Tensor):
        _torch()  # its dtype table and stream getter
        return _read_torch
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(getattr(cupy, "ndarray", None), type) and issubclass(kind, cupy.ndarray):
        return _read_cupy
    return _no_fast_path


def masked_array_error(name: str) -> TypeError:
    """The refusal of a numpy masked array: its data would be read as it is, masked entries included (an
    expert id, a NaN weight), since the mask is no part of the memory (the JAX front raises it too)."""
    return TypeError(f"{name} is a numpy masked array, whose mask the call would ignore; pass the values to use "
                     f"(np.ma.filled(array, fill_value))")


def _refuse_masked(obj: Any, name: str, stream: int | None) -> None:
    raise masked_array_error(name)


# The framework of the arrays a reader serves, also when they go through DLPack.
_FRAMEWORK_OF_READER = {_read_numpy: "numpy", _read_torch: "torch", _read_cupy: "cupy"}
# Reader by exact array type, filled as types are first seen: one dict lookup per array read.
_READERS: dict[type, Callable[[Any, str, int | None], ArrayView | None]] = {}
_MAX_READERS = 256


# ---------------------------------------------------------------------------------------------
# DeviceMemoryArray


class DeviceMemoryArray:
    """Memory we own (device or host), exported to any framework through DLPack.

    ``torch.from_dlpack``, ``jax.dlpack.from_dlpack``, ``cupy.from_dlpack`` and
    ``np.from_dlpack`` (numpy dtypes only) all accept it and share the memory.

    Example::

        out = DeviceMemoryArray(ptr, (num_tokens, hidden), "bfloat16", "cuda", 0, owner=buffer)
        recv_x = torch.from_dlpack(out)   # keeps `buffer` alive while recv_x lives

    Args:
        ptr: address of element ``[0, ..., 0]``; C-contiguous layout.
        shape: extents; the strides are :func:`c_contiguous_strides` of it.
        dtype: one of :data:`DTYPES`.
        device_type: ``"cuda"`` (a device address) or ``"cpu"`` (a host address).
        device_id: CUDA ordinal for ``"cuda"``; must be 0 for ``"cpu"``.
        owner: object whose lifetime bounds the memory. Each exported capsule holds a
            reference until the consumer calls its deleter (or the capsule dies unconsumed).

    Raises:
        TypeError: ``dtype`` or ``device_type`` is not supported.
        ValueError: ``ptr``, ``shape`` or ``device_id`` is out of range.

    Note:
        No stream is tracked: ``__dlpack__(stream=...)`` orders nothing. Export only memory
        whose writes are already ordered before the consumer's stream (the kernel ran on it,
        or was waited for).
    """

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: str, device_type: str,
                 device_id: int, owner: object) -> None:
        if not isinstance(ptr, int) or ptr < 0:
            raise ValueError(f"DeviceMemoryArray: ptr must be an address (int >= 0), got {ptr!r}")
        shape = tuple(shape)
        if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in shape):
            raise ValueError(f"DeviceMemoryArray: shape must be non-negative ints, got {shape}")
        if dtype not in _DTYPE_TO_DLPACK:
            raise TypeError(f"DeviceMemoryArray: dtype must be one of {DTYPES}, got {dtype!r}")
        if device_type == "cuda":
            dl_device_type = DLDeviceType.kDLCUDA
        elif device_type == "cpu":
            dl_device_type = DLDeviceType.kDLCPU
        else:
            raise TypeError(f"DeviceMemoryArray: device_type must be 'cuda' or 'cpu', "
                            f"got {device_type!r}")
        if ptr == 0 and math.prod(shape) > 0:
            raise ValueError(f"DeviceMemoryArray: ptr must be non-zero for {shape} elements")
        if not isinstance(device_id, int) or device_id < 0 or (device_type == "cpu" and device_id):
            raise ValueError(f"DeviceMemoryArray: device_id must be a CUDA ordinal (>= 0), or 0 "
                             f"for 'cpu', got {device_id!r}")
        self._ptr = ptr
        self._shape = tuple(int(n) for n in shape)
        self._dtype = dtype
        self._device_type = device_type
        self._device_id = device_id
        self._dl_device = (dl_device_type, device_id)
        self._owner = owner

    ptr = property(lambda self: self._ptr, doc="Address of element ``[0, ..., 0]``.")
    shape = property(lambda self: self._shape, doc="Extents.")
    strides = property(lambda self: c_contiguous_strides(self._shape), doc="In elements.")
    dtype = property(lambda self: self._dtype, doc="One of :data:`DTYPES`.")
    device_type = property(lambda self: self._device_type, doc="``'cuda'`` or ``'cpu'``.")
    device_id = property(lambda self: self._device_id, doc="CUDA ordinal; 0 for ``'cpu'``.")
    owner = property(lambda self: self._owner, doc="Keeps the memory valid.")

    def __repr__(self) -> str:
        return (f"DeviceMemoryArray(ptr={self._ptr:#x}, shape={self._shape}, dtype={self._dtype}"
                f", device={self._device_type}:{self._device_id})")

    def __dlpack_device__(self) -> tuple[int, int]:
        """Returns ``(DLDeviceType, device_id)``."""
        return self._dl_device

    def __dlpack__(self, stream: int | None = None, *, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """Returns a DLPack capsule over the memory, never a copy.

        Args:
            stream: the consumer's stream; accepted and not used (see the class note).
            max_version: newest DLPack the consumer reads; ``>= (1, 0)`` gets a
                ``"dltensor_versioned"`` capsule, ``None`` a legacy ``"dltensor"`` one.
            dl_device: must be None or this array's device.
            copy: ``True`` is refused (we never copy).

        Raises:
            BufferError: a copy, another device or a DLPack older than
                :data:`MIN_DLPACK_VERSION` was asked for.
        """
        if copy:
            raise BufferError("DeviceMemoryArray.__dlpack__: copy=True is not supported; import "
                              "without a copy and copy in the consumer's framework")
        if dl_device is not None and tuple(dl_device) != self._dl_device:
            raise BufferError(f"DeviceMemoryArray.__dlpack__: dl_device must be {self._dl_device}"
                              f" (the memory's device), got {dl_device}")
        if max_version is not None and tuple(max_version) < MIN_DLPACK_VERSION:
            raise BufferError(f"DeviceMemoryArray.__dlpack__: max_version must be at least "
                              f"{MIN_DLPACK_VERSION}, got {max_version}")
        versioned = max_version is not None and max_version[0] >= 1
        # numpy's C exporter makes the capsule (see _dlpack.build_capsule for why), over an
        # unsigned-int array that never touches the memory and whose base holds the owner.
        raw = _numpy_over(self._ptr, self._shape, c_contiguous_strides(self._shape), self._dtype,
                          False, self._owner, raw_bits=True)
        code, bits = _DTYPE_TO_DLPACK[self._dtype]
        return _dlpack.build_capsule(raw, versioned=versioned, code=code, bits=bits,
                                     dl_device=self._dl_device)
