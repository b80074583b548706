"""Tests of the DLPack boundary (mooncake_ep.tensor) and the framework glue, on the CPU.

Values encode their position (element i holds i mod 64, which bf16 and fp8 e4m3fn hold exactly),
so a wrong pointer or stride shows up as a wrong value, not only as a wrong shape.
"""

from __future__ import annotations

import ast
import ctypes
import weakref
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import mooncake_ep.tensor as tensor_module
from mooncake_ep import frameworks
from mooncake_ep.tensor import (
    DLPACK_VERSION,
    DLManagedTensor,
    DeviceMemoryArray,
    c_contiguous_strides,
    numpy_dtype,
    read_array,
    swapped_last_axes_strides,
)

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

_capsule_name = ctypes.pythonapi["PyCapsule_GetName"]
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

# XLA imports CPU memory without a copy only at this alignment.
XLA_CPU_ALIGNMENT = 64


def positional(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Element i (row-major) holds i mod 64: exact in every supported dtype, bool aside."""
    values = np.arange(int(np.prod(shape))) % 64
    if dtype == "bool":
        values = values % 2
    return values.astype(numpy_dtype(dtype)).reshape(shape)


class Owner:
    """Owns a 64-byte aligned host buffer; weak references tell when it is released."""

    def __init__(self, nbytes: int) -> None:
        self.storage = np.zeros(nbytes + XLA_CPU_ALIGNMENT, np.uint8)
        offset = -self.storage.ctypes.data % XLA_CPU_ALIGNMENT
        self.bytes = self.storage[offset:offset + nbytes]
        self.ptr = self.bytes.ctypes.data


def exported(values: np.ndarray) -> tuple[DeviceMemoryArray, weakref.ref]:
    """A DeviceMemoryArray over a private copy of ``values``, and a weak ref to its owner."""
    owner = Owner(values.nbytes)
    owner.bytes[:] = values.reshape(-1).view(np.uint8)
    dtype = read_array(values, name="test").dtype
    return DeviceMemoryArray(owner.ptr, values.shape, dtype, "cpu", 0, owner), weakref.ref(owner)


class DLPackOnly:
    """Forwards only __dlpack__/__dlpack_device__ (forces the DLPack path), recording kwargs."""

    def __init__(self, array, device=None):
        self.array = array
        self.device = device
        self.calls = []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self.array.__dlpack__(max_version=kwargs.get("max_version"))

    def __dlpack_device__(self):
        return self.device or self.array.__dlpack_device__()


class LegacyProducer(DLPackOnly):
    """A pre-1.0 producer: rejects max_version, returns a legacy "dltensor" capsule."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        return self.array.__dlpack__()


class CopyingProducer(DLPackOnly):
    """A producer that cannot share its memory and exports a copy, flagged IS_COPIED (which DLPack allows
    when the consumer does not ask for copy=False)."""

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self.array.__dlpack__(max_version=kwargs.get("max_version"), copy=True)


class NotACapsule(DLPackOnly):
    """A producer whose __dlpack__ returns the array itself (a bug)."""

    def __dlpack__(self, **kwargs):
        return self.array


class StreamlessProducer(DLPackOnly):
    """A producer whose __dlpack__ takes no argument at all (TensorFlow's EagerTensor)."""

    def __dlpack__(self):
        self.calls.append({})
        return self.array.__dlpack__()


# ---------------------------------------------------------------------------------------------
# read_array


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float16", "float32", "float64",
                                   "int8", "int32", "int64", "uint8", "uint16", "bool"])
def test_numpy_dtypes_round_trip(dtype):
    x = positional((3, 5), dtype)
    view = read_array(x, name="test: x")
    assert (view.dtype, view.shape, view.strides) == (dtype, (3, 5), (5, 1))
    assert (view.device_type, view.device_id, view.framework) == ("cpu", 0, "numpy")
    assert view.ptr == x.ctypes.data and view.is_contiguous
    assert view.itemsize == x.itemsize and view.nbytes == x.nbytes and view.size == 15
    np.testing.assert_array_equal(view.numpy(), x)
    assert view.numpy().dtype == x.dtype


def test_numpy_non_contiguous_slices():
    x = positional((6, 8), "bfloat16")
    for sliced, strides in [(x[::2, 1::3], (16, 3)), (x.T, (1, 8)), (x[:, ::-1], (8, -1))]:
        view = read_array(sliced, name="test: x")
        assert view.strides == strides and not view.is_contiguous
        assert view.ptr == sliced.__array_interface__["data"][0]
        np.testing.assert_array_equal(view.numpy(), sliced)


def test_numpy_zero_d_empty_and_unit_dims():
    scalar = read_array(np.array(7, np.int32), name="test: x")
    assert scalar.shape == () and scalar.strides == () and scalar.size == 1 and scalar.ndim == 0
    assert scalar.numpy() == 7 and scalar.is_contiguous
    empty = read_array(np.zeros((0, 4), ml_dtypes.float8_e4m3fn), name="test: x")
    assert empty.shape == (0, 4) and empty.size == 0 and empty.nbytes == 0 and empty.is_contiguous
    assert empty.numpy().shape == (0, 4)
    column = read_array(positional((4, 6), "float32")[:, 2:3], name="test: x")
    assert column.strides == (6, 1) and not column.is_contiguous
    row = read_array(positional((4, 6), "float32")[1:2, :], name="test: x")
    assert row.is_contiguous  # a dimension of extent 1 may have any stride


def test_swapped_last_axes_layout():
    """DeepEP's fp8 scales: [E, rows, columns] viewed over a C-contiguous [E, columns, rows]."""
    assert swapped_last_axes_strides((4, 6, 3)) == (18, 1, 6)
    assert swapped_last_axes_strides((6, 3)) == (1, 6)
    swapped = read_array(np.zeros((4, 3, 6), np.float32).swapaxes(1, 2), name="test: x")
    assert swapped.strides == (18, 1, 6) and swapped.is_swapped_last_axes and not swapped.is_contiguous
    torch_swapped = read_array(torch.zeros(4, 3, 6).transpose(1, 2), name="test: x")
    assert torch_swapped.strides == (18, 1, 6) and torch_swapped.is_swapped_last_axes
    row_major = read_array(np.zeros((4, 6, 3), np.float32), name="test: x")
    assert row_major.is_contiguous and not row_major.is_swapped_last_axes
    # Extents of 1 may have any stride, and an empty array has every layout.
    assert read_array(np.zeros((4, 1, 3), np.float32), name="test: x").is_swapped_last_axes
    assert read_array(np.zeros((4, 0, 3), np.float32), name="test: x").is_swapped_last_axes
    # Dense but neither: the outer dimension inside.
    outer_inside = read_array(np.zeros((6, 3, 4), np.float32).transpose(2, 0, 1), name="test: x")
    assert not outer_inside.is_swapped_last_axes and not outer_inside.is_contiguous
    every_other_row = read_array(np.zeros((4, 3, 12), np.float32).swapaxes(1, 2)[:, ::2], name="test: x")
    assert not every_other_row.is_swapped_last_axes


def test_a_numpy_masked_array_is_refused():
    """Its mask is no part of the memory: a masked expert id or NaN weight would be used as it is."""
    masked = np.ma.masked_array(np.arange(6, dtype=np.int64).reshape(3, 2), mask=[[0, 1], [0, 0], [0, 0]])
    with pytest.raises(TypeError, match=r"^test: topk_idx is a numpy masked array, whose mask the call would ignore"):
        read_array(masked, name="test: topk_idx")
    assert read_array(np.ma.filled(masked, -1), name="test: topk_idx").shape == (3, 2)


def test_numpy_view_keeps_memory_and_readonly():
    x = positional((4,), "float32")
    view = read_array(x, name="test: x")
    alias = view.numpy()
    alias[0] = 99.0  # zero-copy: writes reach the caller's array
    assert x[0] == 99.0
    x.flags.writeable = False
    frozen = read_array(x, name="test: x")
    assert frozen.readonly and not frozen.numpy().flags.writeable


def test_torch_fast_path():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    view = read_array(x.t(), name="test: x")
    assert view.framework == "torch" and view.keepalive is not None
    assert (view.shape, view.strides, view.dtype) == ((4, 3), (1, 4), "bfloat16")
    assert not view.is_contiguous and view.ptr == x.data_ptr()
    np.testing.assert_array_equal(view.numpy().astype(np.float32), x.t().float().numpy())
    offset = read_array(x[1:], name="test: x")
    assert offset.ptr == x.data_ptr() + 4 * 2 and offset.is_contiguous
    for dtype, name in [(torch.float8_e4m3fn, "float8_e4m3fn"), (torch.int64, "int64")]:
        assert read_array(torch.zeros(2, dtype=dtype), name="test: x").dtype == name


def test_torch_negative_view_refused():
    """The imaginary part of a conjugated tensor holds the values' negation in memory: reading the
    memory as it is would flip every sign (torch's own DLPack export does), so it is refused."""
    weights = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64).conj().imag
    assert weights.is_neg()
    with pytest.raises(TypeError, match=r"^combine: topk_weights is a lazily negated view .*\.resolve_neg\(\)"):
        read_array(weights, name="combine: topk_weights")
    resolved = read_array(weights.resolve_neg(), name="combine: topk_weights")
    np.testing.assert_array_equal(resolved.numpy(), [-2.0, -4.0])


class TensorOfItsOwn(torch.Tensor):
    """A torch.Tensor subclass defined outside the torch package."""


def test_torch_subclasses_defined_anywhere_are_torch_tensors():
    x = torch.arange(6, dtype=torch.int32).as_subclass(TensorOfItsOwn)
    assert type(x).__module__ == __name__
    view = read_array(x, name="test: x")
    assert (view.framework, view.ptr, view.shape) == ("torch", x.data_ptr(), (6,))


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor:UserWarning")  # torch's, as we read it
def test_fake_tensors_are_refused_before_their_null_pointer_is_used():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty((4, 128), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^dispatch: x has no memory \(data_ptr\(\) is 0\): a fake tensor"):
        read_array(fake, name="dispatch: x")
    empty = torch.empty((0, 128), dtype=torch.bfloat16)  # no elements: a null pointer is fine
    assert read_array(empty, name="dispatch: x").shape == (0, 128)


def test_a_cuda_tensor_is_read_for_another_stream_without_asking_torch_for_its_stream(monkeypatch):
    """A tensor read for another stream than torch's current one is read directly, not exported through
    DLPack (which torch refuses for tensors that need grad, of another device, or for stream 2): the
    reader never asks torch for its current stream, which Buffer._wait_for_writers orders once per
    call. A poisoned context, whose stream query would raise, shows it: the read succeeds."""
    class ReportsCuda(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl
        is_cuda = property(lambda self: True)

        def get_device(self) -> int:
            return 0

    def poisoned_context(device_id: int) -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    tensor_module._torch()
    monkeypatch.setattr(tensor_module, "_torch_stream", [poisoned_context])
    x = torch.zeros((4, 128), dtype=torch.bfloat16, requires_grad=True).as_subclass(ReportsCuda)
    view = read_array(x, name="dispatch: x", stream=12345)
    assert (view.framework, view.device_type, view.device_id, view.ptr) == ("torch", "cuda", 0, x.data_ptr())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_arrays_without_plain_memory_are_refused_naming_the_argument():
    x = torch.zeros((4, 128), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^dispatch: x: this Tensor cannot be read as a strided array in memory"):
        read_array(torch.nested.nested_tensor([x[:2], x[:3]]), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x: this Tensor cannot be read as a strided array in memory"):
        torch.vmap(lambda row: read_array(row, name="dispatch: x").ptr)(x)
    deleted = jnp.zeros((4, 128), jnp.bfloat16)
    deleted.delete()
    # Named as deleted (JAX's own __dlpack_device__ fails with an unrelated TypeError then).
    with pytest.raises(TypeError, match=r"^dispatch: x: this ArrayImpl was deleted \(donated to a jitted call"):
        read_array(deleted, name="dispatch: x")
    import jax

    with pytest.raises(TypeError, match=r"^dispatch: x: a JAX tracer \(\w*Tracer\) holds no memory to read: "
                                        r"inside jax\.jit, grad or shard_map call mooncake_ep\.jax"):
        jax.jit(lambda value: read_array(value, name="dispatch: x").ptr)(jnp.zeros((4, 128), jnp.bfloat16))


def cupy_over_host(shape, dtype, strides=None):
    """A cupy array over host memory: its fast path reads only the pointer and the layout, so no
    GPU is needed as long as nothing dereferences it. Skips where cupy cannot build one."""
    cupy = pytest.importorskip("cupy")
    storage = np.zeros(4096, np.uint8)
    try:
        memory = cupy.cuda.UnownedMemory(storage.ctypes.data, storage.nbytes, storage, device_id=0)
        return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 64), strides=strides)
    except Exception as exc:  # noqa: BLE001 - whatever this cupy build refuses without a driver
        pytest.skip(f"cupy cannot describe host memory here: {exc}")


def test_cupy_fast_path_layouts():
    x = cupy_over_host((3, 4), np.uint16)
    view = read_array(x, name="test: x")
    assert (view.framework, view.device_type, view.device_id) == ("cupy", "cuda", 0)
    assert (view.ptr, view.shape, view.strides, view.dtype) == (x.data.ptr, (3, 4), (4, 1), "uint16")
    transposed = read_array(x.T, name="test: x")  # the same layout again: element strides remembered
    assert (transposed.shape, transposed.strides, transposed.is_contiguous) == ((4, 3), (1, 4), False)
    assert read_array(x.T, name="test: x").strides == (1, 4)
    assert read_array(x[1:], name="test: x").ptr == x.data.ptr + 4 * 2
    assert read_array(cupy_over_host((2, 2), np.float32), name="test: x").strides == (2, 1)


def test_cupy_fast_path_refusals():
    with pytest.raises(ValueError, match=r"^dispatch: x must have strides that are multiples of its itemsize \(2\)"):
        read_array(cupy_over_host((3,), np.uint16, strides=(3,)), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x has a dtype no argument of mooncake_ep takes: cupy dtype "
                                        r">u2.*native byte order"):
        read_array(cupy_over_host((3,), np.dtype(">u2")), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x has a dtype no argument of mooncake_ep takes: .*complex64"):
        read_array(cupy_over_host((3,), np.complex64), name="dispatch: x")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool])
def test_torch_through_dlpack(dtype):
    x = (torch.arange(24) % 64).reshape(4, 6).to(dtype)
    producer = DLPackOnly(x.t())
    view = read_array(producer, name="test: x")
    assert producer.calls == [{"max_version": DLPACK_VERSION}]  # CPU: no stream argument
    assert view.framework == "dlpack" and view.ptr == x.data_ptr()
    assert (view.shape, view.strides, view.is_contiguous) == ((6, 4), (1, 6), False)
    raw_bits = {1: torch.uint8, 2: torch.int16, 8: torch.int64}[x.element_size()]
    expected = x.t().view(raw_bits).numpy()
    np.testing.assert_array_equal(view.numpy().view(expected.dtype), expected)


@pytest.mark.parametrize("dtype,name", [(jnp.bfloat16, "bfloat16"), (jnp.int32, "int32"),
                                        (jnp.float32, "float32")])
def test_jax_through_dlpack(dtype, name):
    x = (jnp.arange(12) % 64).astype(dtype).reshape(3, 4)
    view = read_array(x, name="test: x")
    assert view.framework == "jax" and view.dtype == name
    assert (view.shape, view.strides, view.device_type) == ((3, 4), (4, 1), "cpu")
    np.testing.assert_array_equal(view.numpy(), np.asarray(x))


def test_legacy_and_versioned_capsules():
    x = positional((2, 3), "int32")
    legacy = LegacyProducer(x)
    view = read_array(legacy, name="test: x")
    assert legacy.calls == [{"stream": None}]  # retried without max_version
    np.testing.assert_array_equal(view.numpy(), x)
    versioned = DLPackOnly(x)
    np.testing.assert_array_equal(read_array(versioned, name="test: x").numpy(), x)
    assert versioned.calls == [{"max_version": DLPACK_VERSION}]
    x.flags.writeable = False  # only a versioned capsule can say read-only
    assert read_array(DLPackOnly(x), name="test: x").readonly


def test_consumed_capsule_calls_producer_deleter():
    base = positional((16,), "float32")
    alive = weakref.ref(base)
    capsule = base.__dlpack__(max_version=DLPACK_VERSION)
    view = read_array(capsule, name="test: x")
    assert _capsule_name(capsule) == b"used_dltensor_versioned"
    with pytest.raises(TypeError, match="test: again.*consumed already: a bare capsule is read once.*export the array "
                                        "again for each call"):
        read_array(capsule, name="test: again")
    alias = view.numpy()
    del base, capsule, view
    assert alive() is not None  # the numpy view holds our owner, which holds numpy's tensor
    del alias
    assert alive() is None  # deleter called once the last user is gone


def test_stream_argument_by_producer_kind():
    x = positional((4,), "float32")
    cuda = (2, 0)  # claims CUDA device 0; the capsule itself is host memory
    for stream, passed in [(0, 1), (7, 7), (2, 2), (-1, -1)]:
        producer = DLPackOnly(x, device=cuda)
        read_array(producer, name="test: x", stream=stream)
        assert producer.calls == [{"max_version": DLPACK_VERSION, "stream": passed}]
    cpu = DLPackOnly(x)
    read_array(cpu, name="test: x", stream=7)
    assert cpu.calls == [{"max_version": DLPACK_VERSION}]
    legacy = LegacyProducer(x, device=cuda)
    read_array(legacy, name="test: x", stream=5)
    assert legacy.calls == [{"stream": 5}]
    streamless = StreamlessProducer(x, device=cuda)
    np.testing.assert_array_equal(read_array(streamless, name="test: x", stream=5).numpy(), x)
    assert read_array(torch.ones(2), name="test: x", stream=5).framework == "torch"


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"^dispatch: x must be an array with __dlpack__.*list"):
        read_array([1, 2], name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x has a dtype no argument of mooncake_ep takes: .*complex64"):
        read_array(np.zeros(2, np.complex64), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x has a dtype no argument of mooncake_ep takes: .*>f4"):
        read_array(np.zeros(2, ">f4"), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x has a dtype no argument of mooncake_ep takes: .*complex"):
        read_array(torch.zeros(2, dtype=torch.complex64), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x has a dtype no argument of mooncake_ep takes: .*bits=16"):
        read_array(jnp.zeros(2, jnp.int16), name="dispatch: x")
    with pytest.raises(ValueError, match=r"^dispatch: x: stream must be"):
        read_array(np.zeros(2), name="dispatch: x", stream=-2)
    with pytest.raises(TypeError, match=r"^dispatch: x: .*refused to export"):
        read_array(DLPackOnly(np.zeros(2, ml_dtypes.bfloat16)), name="dispatch: x")
    with pytest.raises(TypeError, match=r"^dispatch: x: __dlpack__ returned a numpy.ndarray, not a DLPack capsule"):
        read_array(NotACapsule(np.zeros(2, np.float32)), name="dispatch: x")


def test_a_copy_exported_by_its_producer_is_read_but_never_written():
    """DLPack lets a producer that cannot share its memory export a copy, flagged IS_COPIED: read, it is
    the right values; written (out=, active_ranks), the writes would never reach the caller."""
    values = np.arange(4, dtype=np.int32)
    view = read_array(CopyingProducer(values), name="dispatch: active_ranks")
    assert view.copied and not view.readonly and view.ptr != values.ctypes.data
    np.testing.assert_array_equal(view.numpy(), values)
    assert not read_array(DLPackOnly(values), name="x").copied
    from mooncake_ep.validation import check_writable
    with pytest.raises(ValueError, match=r"^dispatch: active_ranks was exported by its producer as a copy \(DLPack "
                                         r"IS_COPIED\)"):
        check_writable("dispatch", "active_ranks", view)


def test_a_legacy_capsule_jax_made_reads_as_read_only():
    """JAX exports its immutable arrays through legacy capsules (even when asked for max_version), which have no
    READ_ONLY flag: a capsule whose deleter is jaxlib's code reads as read-only JAX memory, however it arrives,
    and is refused where the call writes. Other producers' legacy capsules stay writable."""
    from mooncake_ep.validation import check_writable

    values = positional((2, 3), "int32")
    array = jnp.asarray(values)
    for obj, framework in [(array.__dlpack__(), "dlpack"), (DLPackOnly(array), "dlpack"), (array, "jax")]:
        view = read_array(obj, name="combine: out combined_x")
        assert (view.readonly, view.jax_memory, view.framework) == (True, True, framework)
        host = view.numpy()
        assert not host.flags.writeable  # not even our own numpy view may change JAX's values
        np.testing.assert_array_equal(host, values)
    with pytest.raises(TypeError, match=r"^combine: out combined_x is a JAX array's memory \(its DLPack capsule was "
                                        r"made by JAX\), which is immutable, and the call writes into it; pass a "
                                        r"torch, cupy or numpy array$"):
        check_writable("combine", "out combined_x", read_array(array.__dlpack__(), name="combine: out combined_x"))
    writable = [torch.utils.dlpack.to_dlpack(torch.from_numpy(values.copy())), values.copy().__dlpack__(),
                LegacyProducer(values.copy())]
    for obj in writable:
        view = read_array(obj, name="combine: out combined_x")
        assert not view.readonly and not view.jax_memory
        check_writable("combine", "out combined_x", view)
        view.numpy()[...] = 0


def test_jax_buffer_callback_buffers_keep_their_flags():
    """The buffers XLA hands a buffer_callback (what mooncake_ep.jax writes its results into) are read through
    versioned capsules, whose READ_ONLY flag JAX sets on the inputs only: the outputs stay writable."""
    buffer_callback = pytest.importorskip("jax.experimental.buffer_callback").buffer_callback
    seen = []

    def callback(ctx, out, x):
        views = [read_array(b, name=name) for b, name in ((out, "output"), (x, "input"))]
        seen.extend((view.readonly, view.jax_memory) for view in views)
        views[0].numpy()[...] = 7

    result = buffer_callback(callback, jax.ShapeDtypeStruct((3,), jnp.int32))(jnp.zeros(3, jnp.int32))
    assert seen == [(False, False), (True, False)]
    np.testing.assert_array_equal(np.asarray(result), [7, 7, 7])


def test_a_capsule_without_memory_is_refused_and_left_unconsumed():
    """A fake or meta tensor's export has elements and a NULL data pointer: refused as torch's reader
    refuses such a tensor, before a kernel would be handed address 0; the producer still frees it."""
    array, alive = exported(positional((4,), "float32"))
    capsule = array.__dlpack__()
    DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor.data = None
    with pytest.raises(TypeError, match=r"^dispatch: active_ranks has no memory \(its DLPack data pointer is NULL\)"):
        read_array(capsule, name="dispatch: active_ranks")
    assert _capsule_name(capsule) == b"dltensor"
    empty = positional((0, 4), "float32").__dlpack__()  # no elements: a NULL pointer is fine
    assert read_array(empty, name="test: empty").shape == (0, 4)
    del array, capsule
    assert alive() is None


def test_a_malformed_capsule_is_refused_and_left_unconsumed():
    """A shape pointer of NULL with dimensions, or a negative ndim, is a producer's bug: refused
    naming the argument, where reading the shape from address 0 would make one up (helper-103)."""
    array, alive = exported(positional((2, 3), "float32"))
    for field, value, ndim in (("shape", None, 2), ("ndim", -1, -1)):
        capsule = array.__dlpack__()
        setattr(DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor, field, value)
        with pytest.raises(TypeError, match=rf"^combine: x: malformed DLPack capsule: ndim {ndim} with shape pointer"):
            read_array(capsule, name="combine: x")
        assert _capsule_name(capsule) == b"dltensor"  # not consumed: its destructor frees it
    del array, capsule
    assert alive() is None


def test_unsupported_device_leaves_capsule_unconsumed():
    array, alive = exported(positional((4,), "float32"))
    capsule = array.__dlpack__()
    DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor")).dl_tensor.device.device_type = 10
    with pytest.raises(TypeError, match=r"^combine: x must be on a CPU or CUDA device.*10 \(ROCM\)"):
        read_array(capsule, name="combine: x")
    assert _capsule_name(capsule) == b"dltensor"  # not consumed: its destructor frees it
    del array, capsule
    assert alive() is None


def test_c_contiguous_strides():
    assert c_contiguous_strides(()) == ()
    assert c_contiguous_strides((2, 3, 4)) == (12, 4, 1)
    assert c_contiguous_strides((0, 3)) == (3, 1)


@pytest.mark.parametrize("module", [tensor_module, frameworks])
def test_import_needs_no_framework(module):
    # Module-level imports only; torch is imported inside the torch fast path, on demand.
    tree = ast.parse(Path(module.__file__).read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.partition(".")[0])
    assert not imported & {"torch", "jax", "jaxlib", "cupy"}


# ---------------------------------------------------------------------------------------------
# DeviceMemoryArray


def _bytes(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.contiguous().view(torch.uint8).numpy().reshape(-1)
    return np.asarray(array).reshape(-1).view(np.uint8)


CONSUMERS = {
    "torch": torch.from_dlpack,
    "numpy": np.from_dlpack,
    "jax": jax.dlpack.from_dlpack,
    "jnp": jnp.from_dlpack,
    "frameworks.numpy": frameworks.get("numpy").wrap,
    "frameworks.torch": frameworks.get("torch").wrap,
    "frameworks.jax": frameworks.get("jax").wrap,
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float32", "int32", "bool"])
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_export_shares_bytes_and_releases_owner(consumer, dtype):
    if consumer == "numpy" and dtype in ("bfloat16", "float8_e4m3fn"):
        pytest.skip("np.from_dlpack rejects bf16/fp8 codes; frameworks.numpy.wrap covers them")
    values = positional((4, 8), dtype)
    array, alive = exported(values)
    imported = CONSUMERS[consumer](array)
    del array
    assert tuple(imported.shape) == (4, 8)
    np.testing.assert_array_equal(_bytes(imported), values.reshape(-1).view(np.uint8))
    alive().bytes[:4] = 0x3C  # shared memory, not a copy
    assert (_bytes(imported)[:4] == 0x3C).all()
    assert alive() is not None  # the consumer's array keeps the owner
    del imported
    assert alive() is None


def test_export_capsule_kinds_and_refusals():
    array, alive = exported(positional((2, 2), "bfloat16"))
    assert array.__dlpack_device__() == (1, 0)
    assert _capsule_name(array.__dlpack__()) == b"dltensor"
    versioned = array.__dlpack__(max_version=(1, 0))
    assert _capsule_name(versioned) == b"dltensor_versioned"
    view = read_array(versioned, name="test: x")  # our own reader reads our export
    assert (view.dtype, view.ptr, view.shape) == ("bfloat16", array.ptr, (2, 2))
    np.testing.assert_array_equal(view.numpy(), positional((2, 2), "bfloat16"))
    with pytest.raises(BufferError, match="copy=True"):
        array.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="dl_device"):
        array.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError, match="max_version"):
        array.__dlpack__(max_version=(0, 5))
    del array, versioned, view
    assert alive() is None  # unconsumed capsules released it too


def test_device_memory_array_validates_arguments():
    with pytest.raises(TypeError, match="dtype must be one of"):
        DeviceMemoryArray(0, (2,), "complex64", "cpu", 0, None)
    with pytest.raises(TypeError, match="device_type must be"):
        DeviceMemoryArray(0, (2,), "float32", "rocm", 0, None)
    with pytest.raises(ValueError, match="shape must be"):
        DeviceMemoryArray(0, (-1,), "float32", "cpu", 0, None)
    with pytest.raises(ValueError, match="ptr must be"):
        DeviceMemoryArray(-8, (2,), "float32", "cpu", 0, None)
    cuda = DeviceMemoryArray(0x1000, (2, 3), "bfloat16", "cuda", 1, None)
    assert cuda.__dlpack_device__() == (2, 1) and cuda.strides == (3, 1)
    view = read_array(cuda, name="test: x")  # the capsule reads back without touching memory
    assert (view.device_type, view.device_id, view.ptr) == ("cuda", 1, 0x1000)
    with pytest.raises(TypeError, match="only CPU memory"):
        view.numpy()


# ---------------------------------------------------------------------------------------------
# frameworks glue (CPU)


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax", "dlpack"])
def test_frameworks_empty_and_from_numpy(framework):
    module = frameworks.get(framework)
    out = read_array(module.empty((2, 3), "bfloat16", "cpu", 0), name="test: out")
    assert (out.shape, out.dtype, out.device_type) == ((2, 3), "bfloat16", "cpu")
    values = positional((3, 4), "bfloat16")[:, ::-1]
    like = read_array(values, name="test: like")
    converted = read_array(module.from_numpy(values, like), name="test: converted")
    assert converted.dtype == "bfloat16"
    np.testing.assert_array_equal(converted.numpy(), values)
    if framework not in ("torch", "jax"):  # torch's needs CUDA; JAX has none outside XLA
        assert module.current_stream(0) == 0


def test_frameworks_refusals():
    with pytest.raises(ValueError, match="framework must be one of"):
        frameworks.get("tensorflow")
    with pytest.raises(TypeError, match="GPU outputs are allocated by XLA"):
        frameworks.get("jax").empty((2,), "float32", "cuda", 0)
    with pytest.raises(TypeError, match="call mooncake_ep.jax.dispatch / mooncake_ep.jax.combine"):
        frameworks.get("jax").current_stream(0)
    with pytest.raises(TypeError, match="would cast to 32 bits"):
        frameworks.get("jax").from_numpy(np.zeros(2, np.int64), read_array(np.zeros(2), name="l"))
    with pytest.raises(TypeError, match="numpy.empty: device_type"):
        frameworks.get("numpy").empty((2,), "float32", "cuda", 0)
    cupy = frameworks.get("cupy")
    with pytest.raises(TypeError, match="cupy.wrap: array.device_type must be 'cuda' for cupy, got 'cpu'"):
        cupy.wrap(DeviceMemoryArray(0x1000, (2,), "bfloat16", "cpu", 0, None))
    with pytest.raises(TypeError, match="cupy.empty: device_type must be 'cuda'"):
        cupy.empty((2,), "bfloat16", "cpu", 0)
    with pytest.raises(TypeError, match="cupy.empty: dtype must be one of"):
        cupy.empty((2,), "complex64", "cuda", 0)


def test_a_torch_without_one_of_the_dtypes_still_reads_its_tensors(monkeypatch):
    """torch.uint16 came in torch 2.3: on an older torch every tensor read raised AttributeError, whatever
    the tensor's own dtype (helper-148)."""
    import mooncake_ep.tensor as tensor_module

    monkeypatch.setattr(tensor_module, "_torch_module", [])
    monkeypatch.setattr(tensor_module, "_torch_stream", [])
    monkeypatch.setattr(tensor_module, "_torch_dtypes", {})
    monkeypatch.delattr(torch, "uint16")
    tensor_module._torch()  # the first load, as a process's first torch tensor makes it
    view = read_array(torch.zeros((2, 3), dtype=torch.bfloat16), name="x")
    assert (view.dtype, view.shape) == ("bfloat16", (2, 3))
    assert "uint16" not in tensor_module._torch_dtypes.values()
