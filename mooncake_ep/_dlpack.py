"""The DLPack C ABI and its capsules: the structs of ``dlpack.h`` and the PyCapsule calls over them.

:mod:`mooncake_ep.tensor` is the library's array boundary (dtype and device names, ArrayView,
DeviceMemoryArray); this module is what it stands on, and knows nothing of our vocabulary:

- the ABI facts: version bounds, flag bits, device type and type codes, the ctypes structs;
- the consumer side: :func:`request_capsule` asks a producer for a capsule,
  :func:`open_capsule` reads its tensor as plain values, :func:`consume_capsule` takes it over;
- who made a capsule: :func:`made_by_jax` tells JAX's legacy capsules, which cannot say that
  their memory is read-only, from the others';
- the producer side: :func:`build_capsule` makes the capsule a :class:`DeviceMemoryArray`
  exports.

No framework is imported: ctypes over ``dlpack.h``, the CPython capsule API and ``dladdr``.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import struct
import sys
from typing import Any, NamedTuple

import numpy as np

_logger = logging.getLogger("mooncake_ep")

# The newest DLPack we speak: 1.1 added kDLFloat8_e4m3fn (code 10), which fp8 dispatch needs.
DLPACK_VERSION = (1, 1)
# The oldest DLPack whose capsules we read and write: kDLBool (code 6) arrived in 0.8; the legacy
# DLManagedTensor layout has not changed since. A versioned capsule must have our major version.
MIN_DLPACK_VERSION = (0, 8)

# DLManagedTensorVersioned.flags bits (dlpack.h).
DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1


class DLDeviceType(enum.IntEnum):
    """``DLDeviceType`` of ``dlpack.h``, the device types we accept."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3  # pinned host memory (cudaMallocHost)
    kDLCUDAManaged = 13  # unified memory (cudaMallocManaged)


class DLDataTypeCode(enum.IntEnum):
    """``DLDataTypeCode`` of ``dlpack.h``, the codes we accept."""

    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLBfloat = 4
    kDLBool = 6
    kDLFloat8_e4m3fn = 10  # DLPack 1.1


# Names of dlpack.h device types, ours or not, for error messages.
DEVICE_TYPE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDAHost", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
                     10: "ROCM", 11: "ROCMHost", 13: "CUDAManaged", 14: "OneAPI"}


# ---------------------------------------------------------------------------------------------
# dlpack.h structs


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # NULL = C-contiguous
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """Legacy (pre-1.0) managed tensor; capsule name ``"dltensor"``."""

    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor *)
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """DLPack >= 1.0 managed tensor; capsule name ``"dltensor_versioned"``."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned *)
        ("flags", ctypes.c_uint64),  # DLPACK_FLAG_BITMASK_*
        ("dl_tensor", DLTensor),
    ]


# ---------------------------------------------------------------------------------------------
# PyCapsule C API


def _capi(symbol: str, restype: Any, *argtypes: Any) -> Any:
    # ctypes.pythonapi[symbol] makes a fresh function object; ctypes.pythonapi.symbol would be the
    # shared, cached one, and setting argtypes on it would change it for every other library.
    function = ctypes.pythonapi[symbol]
    function.restype = restype
    function.argtypes = argtypes
    return function


_PyCapsule_GetName = _capi("PyCapsule_GetName", ctypes.c_char_p, ctypes.py_object)
_PyCapsule_GetPointer = _capi("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object,
                              ctypes.c_char_p)
_PyCapsule_IsValid = _capi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
# PyCapsule_SetName keeps the char * it is given, so names must outlive every capsule.
_PyCapsule_SetName = _capi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_void_p)
_PyMem_RawMalloc = _capi("PyMem_RawMalloc", ctypes.c_void_p, ctypes.c_size_t)


def _static_c_string(text: bytes) -> int:
    """A NUL-terminated copy of ``text`` that is never freed (a capsule may die at exit)."""
    address = _PyMem_RawMalloc(len(text) + 1)
    if not address:
        raise MemoryError("PyMem_RawMalloc failed for a capsule name")
    ctypes.memmove(address, text + b"\0", len(text) + 1)
    return address


_LEGACY_NAME = b"dltensor"
_VERSIONED_NAME = b"dltensor_versioned"
_USED_LEGACY_NAME = _static_c_string(b"used_dltensor")
_USED_VERSIONED_NAME = _static_c_string(b"used_dltensor_versioned")

# Producers' deleters are called with the GIL held, as numpy and torch call them.
_DELETER = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)


class _ConsumedTensor:
    """Owns a managed tensor taken out of a capsule: calls its deleter once, when collected.

    ``__del__`` runs with any in-flight exception saved by CPython, so the producer's deleter
    never sees one.
    """

    __slots__ = ("_managed_ptr", "_deleter", "__weakref__")

    def __init__(self, managed_ptr: int, deleter_ptr: int | None) -> None:
        self._managed_ptr = managed_ptr
        self._deleter = _DELETER(deleter_ptr) if deleter_ptr else None

    def __del__(self) -> None:
        deleter, self._deleter = self._deleter, None
        if deleter is not None:
            deleter(self._managed_ptr)


# ---------------------------------------------------------------------------------------------
# Consumer side: ask for a capsule, read it, take it over

_streamless_producers_warned: set[type] = set()


def is_capsule(obj: object) -> bool:
    """Whether ``obj`` is a bare PyCapsule (a producer's ``__dlpack__`` result)."""
    return type(obj).__name__ == "PyCapsule" and type(obj).__module__ == "builtins"


def request_capsule(obj: Any, name: str, stream: int | None) -> Any:
    """Calls ``obj.__dlpack__`` with the arguments its producer accepts."""
    exporter = getattr(obj, "__dlpack__", None)
    if exporter is None:
        raise TypeError(f"{name} must be an array with __dlpack__ (torch, JAX, cupy, numpy), "
                        f"got {type(obj).__module__}.{type(obj).__qualname__}")
    get_device = getattr(obj, "__dlpack_device__", None)
    try:
        dl_device_type = get_device()[0] if get_device is not None else None
    except Exception as error:  # noqa: BLE001 - whatever the producer raises, named for the caller
        raise _export_error(obj, name, error) from error
    if dl_device_type in (DLDeviceType.kDLCUDA, DLDeviceType.kDLCUDAManaged) and stream is not None:
        # DLPack: the producer makes `stream` wait for its pending writes. 1 = legacy default,
        # 2 = per-thread default, -1 = no synchronisation; 0 is ambiguous and forbidden.
        stream_kwargs = {"stream": 1 if stream == 0 else stream}
    else:
        # CPU and pinned-host producers take no stream: numpy raises RuntimeError, torch an
        # AssertionError, JAX "UNIMPLEMENTED" for anything but None. Pinned torch tensors go
        # through the CPU exporter (jax/_src/dlpack.py notes the same).
        stream_kwargs = {}
    try:
        try:
            return exporter(max_version=DLPACK_VERSION, **stream_kwargs)
        except TypeError:
            # Producers older than DLPack 1.0 (array API 2023) take no max_version; they only
            # make legacy capsules. JAX takes it but still returns a legacy capsule.
            try:
                return exporter(**stream_kwargs)
            except TypeError:
                if not stream_kwargs:
                    raise
                # Producers with no stream parameter at all (TensorFlow's EagerTensor; see
                # jax/_src/dlpack.py): the export cannot be ordered on our stream.
                if type(obj) not in _streamless_producers_warned:
                    _streamless_producers_warned.add(type(obj))
                    _logger.warning("%s: %s.__dlpack__ takes no stream; its pending writes are "
                                    "not ordered before our launch", name, type(obj).__qualname__)
                return exporter()
    except BufferError as error:
        raise TypeError(f"{name}: {type(obj).__qualname__} refused to export through DLPack: "
                        f"{error}") from error
    except Exception as error:  # noqa: BLE001 - a deleted JAX array, a tracer, ...: named for the caller
        raise _export_error(obj, name, error) from error


def _export_error(obj: Any, name: str, error: Exception) -> TypeError:
    """What the producer raised, as a TypeError naming the argument (the producer's error chained)."""
    kind = type(obj)
    if kind.__module__.partition(".")[0] == "jax" and "Tracer" in kind.__name__:
        return TypeError(f"{name}: a JAX tracer ({kind.__qualname__}) holds no memory to read: inside jax.jit, grad "
                         f"or shard_map call mooncake_ep.jax.dispatch / combine")
    is_deleted = getattr(obj, "is_deleted", None)
    if callable(is_deleted) and is_deleted() is True:  # JAX: its __dlpack_device__ then fails obscurely
        return TypeError(f"{name}: this {kind.__qualname__} was deleted (donated to a jitted call, or .delete()); "
                         f"pass a live array")
    return TypeError(f"{name}: {kind.__qualname__} could not be exported through DLPack "
                     f"({type(error).__name__}: {error})")


class CapsuleTensor(NamedTuple):
    """The ``DLTensor`` of an opened capsule, as plain values; the capsule is not consumed yet.

    Attributes:
        code, bits, lanes: the ``DLDataType``, unchecked.
        device_type, device_id: the ``DLDevice``, unchecked.
        shape: extents.
        strides: in elements; None where ``dlpack.h`` has NULL (compact row-major).
        ptr: ``data + byte_offset`` (``data`` NULL reads as 0).
        readonly: ``DLPACK_FLAG_BITMASK_READ_ONLY``. A legacy capsule has no flags: it reads
            True when JAX made it (:attr:`made_by_jax`), False otherwise.
        copied: ``DLPACK_FLAG_BITMASK_IS_COPIED`` (the producer exported a copy); always False
            for a legacy capsule.
        made_by_jax: a legacy capsule whose deleter is jaxlib's code (:func:`made_by_jax`): the
            memory of a JAX array, which JAX assumes never changes.
        managed_address, deleter, used_name: for :func:`consume_capsule`: the managed tensor,
            its deleter (None for NULL) and the capsule's name once consumed (a ``char *``).

    (A named tuple: every array read through DLPack opens one, and a frozen dataclass of these
    fields cost ~2 us more to build.)
    """

    code: int
    bits: int
    lanes: int
    device_type: int
    device_id: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None
    ptr: int
    readonly: bool
    copied: bool
    made_by_jax: bool
    managed_address: int
    deleter: int | None
    used_name: int


# The managed tensors read by struct from one copy of their bytes: ctypes reads each field through
# an object of its own (~9 us an open for these ~12 fields, ~2 us this way). The formats are
# those of the ctypes structs above, which stay the layouts' definition (checked below).
_DL_TENSOR = struct.Struct("@PiiiBBHPPQ")  # data, device_type, device_id, ndim, code, bits, lanes,
#                                              shape, strides, byte_offset
_VERSIONED_HEAD = struct.Struct("@IIPPQ")  # version.major, version.minor, manager_ctx, deleter, flags
_POINTER = struct.Struct("@P")
_LEGACY_DELETER_OFFSET = DLManagedTensor.deleter.offset
_VERSIONED_TENSOR_OFFSET = DLManagedTensorVersioned.dl_tensor.offset
assert _DL_TENSOR.size == ctypes.sizeof(DLTensor) and DLManagedTensor.dl_tensor.offset == 0, "DLTensor's layout"
assert _VERSIONED_HEAD.size == _VERSIONED_TENSOR_OFFSET, "DLManagedTensorVersioned's layout"
_MANAGED_BYTES = {False: ctypes.sizeof(DLManagedTensor), True: ctypes.sizeof(DLManagedTensorVersioned)}


def _int64s(address: int, count: int) -> tuple[int, ...]:
    return struct.unpack(f"@{count}q", ctypes.string_at(address, 8 * count)) if count else ()


def open_capsule(capsule: Any, name: str) -> CapsuleTensor:
    """Reads a DLPack capsule's tensor without consuming it.

    Raises:
        TypeError: the capsule is not named ``"dltensor"`` or ``"dltensor_versioned"`` (a
            ``used_`` name was consumed already), or is versioned with another major version.
            The capsule is left untouched: its own destructor frees it.
    """
    if type(capsule).__name__ != "PyCapsule":  # a producer's bug: PyCapsule_GetName would say nothing useful
        raise TypeError(f"{name}: __dlpack__ returned a {type(capsule).__module__}.{type(capsule).__qualname__}, "
                        f"not a DLPack capsule")
    capsule_name = _PyCapsule_GetName(capsule)
    versioned = capsule_name == _VERSIONED_NAME
    if not versioned and capsule_name != _LEGACY_NAME:
        raise TypeError(f"{name}: __dlpack__ returned a capsule named {capsule_name!r}, expected "
                        f"'dltensor' or 'dltensor_versioned' (a 'used_' name was consumed already: a bare "
                        f"capsule is read once, by the call it is passed to, even one that was then refused; "
                        f"export the array again for each call)")
    address = _PyCapsule_GetPointer(capsule, capsule_name)
    managed = ctypes.string_at(address, _MANAGED_BYTES[versioned])
    if versioned:
        major, minor, _, deleter, flags = _VERSIONED_HEAD.unpack_from(managed)
        if major != DLPACK_VERSION[0]:
            # Not consumed: the capsule's own destructor frees it.
            raise TypeError(f"{name}: DLPack {major}.{minor} capsule, this reader speaks DLPack "
                            f"{DLPACK_VERSION[0]}.x")
        readonly = bool(flags & DLPACK_FLAG_BITMASK_READ_ONLY)
        copied = bool(flags & DLPACK_FLAG_BITMASK_IS_COPIED)
        jax = False  # the flags say it (JAX's buffer_callback buffers set READ_ONLY on their inputs)
        used_name = _USED_VERSIONED_NAME
        tensor_offset = _VERSIONED_TENSOR_OFFSET
    else:
        (deleter,) = _POINTER.unpack_from(managed, _LEGACY_DELETER_OFFSET)
        # A legacy capsule has no flags. JAX exports its immutable arrays through legacy capsules
        # only (even when asked for max_version), so one JAX made is read-only; others may be written.
        readonly = jax = made_by_jax(deleter)
        copied = False
        used_name = _USED_LEGACY_NAME
        tensor_offset = 0
    data, device_type, device_id, ndim, code, bits, lanes, shape, strides, byte_offset = \
        _DL_TENSOR.unpack_from(managed, tensor_offset)
    if ndim < 0 or (ndim and not shape):  # string_at would read a NULL pointer's "bytes" as a shape
        raise TypeError(f"{name}: malformed DLPack capsule: ndim {ndim} with shape pointer {shape:#x}")
    return CapsuleTensor(code, bits, lanes, device_type, device_id, _int64s(shape, ndim),
                         _int64s(strides, ndim) if strides else None, (data or 0) + byte_offset, readonly, copied,
                         jax, address, deleter or None, used_name)


def consume_capsule(capsule: Any, opened: CapsuleTensor, name: str) -> object:
    """Takes over the tensor of an opened capsule; returns its owner.

    Returns:
        An object that keeps the tensor's memory valid and calls the producer's deleter once,
        when it is collected.

    Raises:
        RuntimeError: the capsule could not be renamed (it is then left as it was).
    """
    # Consume, as the protocol says: rename first, so the capsule's destructor leaves the tensor
    # to us, then own the deleter call.
    if _PyCapsule_SetName(capsule, opened.used_name) != 0:
        raise RuntimeError(f"{name}: PyCapsule_SetName failed on a DLPack capsule")
    return _ConsumedTensor(opened.managed_address, opened.deleter)


# ---------------------------------------------------------------------------------------------
# Who made a capsule: JAX's legacy capsules


class _DlInfo(ctypes.Structure):
    """``Dl_info`` of ``<dlfcn.h>``, which ``dladdr`` fills."""

    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _load_dladdr() -> Any:
    """``dladdr`` from the C library (glibc >= 2.34, macOS) or libdl (older glibc); None without one (Windows)."""
    for library in (None, "libdl.so.2"):
        try:
            function = ctypes.CDLL(library).dladdr  # a CDLL of our own: its function objects are ours to set
        except (AttributeError, OSError, TypeError):  # no such symbol, no such library, CDLL(None) on Windows
            continue
        function.restype = ctypes.c_int
        function.argtypes = (ctypes.c_void_p, ctypes.POINTER(_DlInfo))
        return function
    return None


_dladdr: list[Any] = []  # [dladdr or None], loaded when the first legacy capsule's deleter is looked up


def _library_of(address: int) -> str | None:
    """The path of the shared library whose code is at ``address``; None where dladdr cannot tell."""
    if not _dladdr:
        _dladdr.append(_load_dladdr())
    dladdr = _dladdr[0]
    info = _DlInfo()
    if dladdr is None or not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _is_code_of(address: int, package: str) -> bool:
    """Whether the code at ``address`` is in a shared library inside an imported package's directory."""
    module = sys.modules.get(package)
    if module is None:  # never imported, so none of its code is loaded
        return False
    library = _library_of(address)
    if library is None:
        return False
    library = os.path.realpath(library)
    return any(library.startswith(os.path.join(os.path.realpath(folder), ""))
               for folder in getattr(module, "__path__", ()))


def made_by_jax(deleter: int | None) -> bool:
    """Whether a capsule whose managed tensor has this ``deleter`` was made by JAX.

    JAX's export code, and so its deleter, is in a shared library of the ``jaxlib`` package
    (``libjax_common.so``, ``xla_extension.so`` in older releases); ``dladdr`` names the library
    of an address. Remembered per deleter (a process has a few), so a capsule costs one lookup.

    Note:
        Where ``dladdr`` is missing (Windows) nothing reads as JAX's. The legacy capsules of the
        buffers XLA hands a ``buffer_callback`` read as JAX's too, its writable outputs included:
        :func:`request_capsule` asks for a versioned capsule, whose flags tell them apart.
    """
    if not deleter:
        return False
    found = _MADE_BY_JAX.get(deleter)
    if found is None:
        if len(_MADE_BY_JAX) >= _MAX_DELETERS:
            _MADE_BY_JAX.clear()
        found = _MADE_BY_JAX[deleter] = _is_code_of(deleter, "jaxlib")
    return found


# deleter address -> whether it is jaxlib's code.
_MADE_BY_JAX: dict[int, bool] = {}
_MAX_DELETERS = 64


# ---------------------------------------------------------------------------------------------
# Producer side: the capsule a DeviceMemoryArray exports


def build_capsule(raw: np.ndarray, *, versioned: bool, code: int, bits: int,
                  dl_device: tuple[int, int]) -> Any:
    """A capsule over ``raw``'s memory that says dtype ``(code, bits, 1)`` on ``dl_device``.

    Args:
        raw: unsigned ints of the element width over the memory; numpy never reads them. Its
            base keeps the memory's owner alive, and the capsule keeps ``raw``.
        versioned: make a ``"dltensor_versioned"`` capsule (DLPack :data:`DLPACK_VERSION`)
            where numpy can; otherwise, and with numpy < 2.1, a legacy ``"dltensor"`` one.
        code, bits: the ``DLDataType`` to report (lanes 1).
        dl_device: ``(DLDeviceType, device_id)`` to report.
    """
    # The managed tensor, its deleter and the capsule come from numpy's C exporter. A deleter or
    # capsule destructor written in Python (a ctypes callback) is unsafe: it may run while an
    # exception is being raised (a temporary tensor freed during unwind), and CPython then turns
    # its return into a SystemError and loses that exception. numpy's C code saves and restores
    # it. We then correct the device and the dtype code.
    capsule = None
    if versioned:
        try:
            capsule = raw.__dlpack__(max_version=DLPACK_VERSION)
        except TypeError:
            pass  # numpy < 2.1 exports legacy capsules only; consumers accept those too
    if capsule is None:
        capsule = raw.__dlpack__()
    capsule_name = _PyCapsule_GetName(capsule)
    address = _PyCapsule_GetPointer(capsule, capsule_name)
    if capsule_name == _VERSIONED_NAME:
        managed: Any = DLManagedTensorVersioned.from_address(address)
        managed.version = DLPackVersion(*DLPACK_VERSION)
    else:
        managed = DLManagedTensor.from_address(address)
    managed.dl_tensor.dtype = DLDataType(code, bits, 1)
    managed.dl_tensor.device = DLDevice(*dl_device)
    return capsule
