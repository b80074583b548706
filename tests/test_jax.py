"""mooncake_ep.jax on the CPU: the ops eagerly, under jax.jit and shard_map, the split form, gradients.

Every result is compared with mooncake_ep.reference on the same global inputs: dispatch rows bit for
bit up to recv_count, combine bit for bit (the CPU path is the reference), masks exactly. Inputs
encode their origin (channel 0 = source rank, channel 1 = token, exact in bf16), so a misrouted row
names its source. The GPU launch path of the ops (what the buffer_callback launches, on which stream,
with which parity) is checked here too, on a recording stand-in for the CUDA backend.

Each in-process rank has its own JAX CPU device (tests/conftest.py): XLA runs one device's programs
one at a time, and the ranks' collectives must meet.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import _cases
from _cases import BF16, Case, bits, reference_step  # one definition for both in-process tests

import mooncake_ep as ep
from mooncake_ep import reference
from mooncake_ep.group import free_port
from mooncake_ep.tensor import DeviceMemoryArray

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
epj = pytest.importorskip("mooncake_ep.jax")
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mooncake_ep.frameworks import jax_args, jax_ops  # noqa: E402

GROUP_TIMEOUT_S = 30.0
FLAGS = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8-round": dict(use_fp8=True, round_scale=True),
    "fp8-ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}


def cpu_devices(n: int):
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} JAX CPU devices (tests/conftest.py sets jax_num_cpu_devices)")
    return devices[:n]


def make_case(seed: int, **kwargs) -> Case:
    """A case with int32 ids (x64 is off in JAX), its token counts drawn as this file always drew them."""
    return _cases.make_case(seed, topk_dtype=np.int32, draw_rank0_count=False, **kwargs)


def expert_fn(rank: int, recv, flags: dict):
    """The experts, in jax.numpy: global expert e scales its (dequantised) rows by (e + 1) / 4."""
    if flags.get("use_fp8", True):
        q, scales = recv
        num_local, rows, hidden = q.shape
        if flags.get("use_ue8m0"):
            exponents = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(num_local, rows, -1)
            scale = jax.lax.bitcast_convert_type(exponents[..., : hidden // 128].astype(jnp.uint32) << 23, jnp.float32)
        else:
            scale = scales
        values = (q.astype(jnp.float32).reshape(num_local, rows, -1, 128) * scale[..., None]).reshape(q.shape)
    else:
        values = recv.astype(jnp.float32)
    num_local = values.shape[0]
    factor = (rank * num_local + jnp.arange(num_local, dtype=jnp.float32) + 1) / 4
    return (values * factor[:, None, None]).astype(jnp.bfloat16)


def expert_fn_np(rank: int, result: reference.DispatchResult, flags: dict) -> np.ndarray:
    recv = (result.recv_x, result.recv_scales) if flags.get("use_fp8", True) else result.recv_x
    return np.asarray(expert_fn(rank, jax.tree_util.tree_map(jnp.asarray, recv), flags))


def expected(case: Case, flags: dict, renormalize: bool = False):
    return reference_step(case, flags, expert_fn_np, renormalize)


def check_rank(rank: int, want: reference.DispatchResult, recv, count, flags) -> None:
    count = np.asarray(count)
    np.testing.assert_array_equal(count, want.recv_count, err_msg=f"rank {rank}: recv_count")
    q, scales = recv if flags.get("use_fp8", True) else (recv, None)
    q = np.asarray(q)
    assert q.shape == want.recv_x.shape and q.dtype == want.recv_x.dtype, f"rank {rank}"
    for e, n in enumerate(want.recv_count):
        np.testing.assert_array_equal(bits(q[e, :n]), bits(want.recv_x[e, :n]), err_msg=f"rank {rank} expert {e}")
        if scales is not None:
            np.testing.assert_array_equal(np.asarray(scales)[e, :n], want.recv_scales[e, :n],
                                          err_msg=f"rank {rank} expert {e} scales")


def spawn(num_ranks: int, fn):
    return ep.LocalGroup(num_ranks, timeout_s=GROUP_TIMEOUT_S).spawn(fn)


def reference_buffer(group, case: Case, num_bytes=None) -> ep.Buffer:
    return ep.Buffer(group, case.size_hint if num_bytes is None else num_bytes, backend="reference")


# --- one rank per thread, each with its own CPU device: eager and jit ----------------------------------


def rank_step(buffer, case: Case, rank: int, flags: dict, jit: bool, sizes=None):
    """``sizes``: T and E as the op gets them (the case's ints by default)."""
    num_max_tokens, num_experts = sizes or (case.num_max_tokens, case.num_experts)

    def step(x, topk, weights, active):
        recv, count, handle, active = epj.dispatch(buffer, x, topk, active, num_max_tokens, num_experts, **flags)
        y = expert_fn(rank, recv, flags)
        combined, active = epj.combine(buffer, y, topk, weights, active, handle)
        return recv, count, combined, active

    run = jax.jit(step) if jit else step
    with jax.default_device(jax.devices("cpu")[rank]):
        args = [jnp.asarray(a) for a in (case.xs[rank], case.topk_idxs[rank], case.weights[rank], case.actives[rank])]
        return jax.tree_util.tree_map(np.asarray, run(*args))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("flag_id", list(FLAGS))
def test_dispatch_and_combine_equal_reference(flag_id, jit):
    flags = FLAGS[flag_id]
    case = make_case(1, num_ranks=3, num_experts=6, num_topk=3)
    cpu_devices(3)
    results = spawn(3, lambda g: rank_step(reference_buffer(g, case), case, g.rank, flags, jit))
    dispatched, combined = expected(case, flags)
    for rank, (recv, count, out, active) in enumerate(results):
        check_rank(rank, dispatched[rank], recv, count, flags)
        np.testing.assert_array_equal(bits(out), bits(combined[rank][0]), err_msg=f"rank {rank}: combined")
        np.testing.assert_array_equal(active, combined[rank][1], err_msg=f"rank {rank}: mask")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_numpy_integer_sizes_give_the_results_of_python_ints(jit):
    # In uint8 arithmetic the R * T = 400 rows per expert of recv_x would wrap to 144.
    flags = FLAGS["bf16"]
    case = make_case(13, num_ranks=2, num_max_tokens=200, hidden=128, num_experts=4)
    cpu_devices(2)
    results = spawn(2, lambda g: rank_step(reference_buffer(g, case), case, g.rank, flags, jit,
                                           sizes=(np.uint8(200), np.uint8(4))))
    dispatched, combined = expected(case, flags)
    for rank, (recv, count, out, _) in enumerate(results):
        check_rank(rank, dispatched[rank], recv, count, flags)
        np.testing.assert_array_equal(bits(out), bits(combined[rank][0]), err_msg=f"rank {rank}: combined")


def test_the_mask_comes_back_and_the_input_is_untouched():
    # Rank 0 masks rank 1; rank 1 does not know, times out on rank 0 (on the reference: at once) and masks it.
    case = make_case(2, actives=[[1, 0], [1, 1]], num_tokens=[4, 4])
    cpu_devices(2)

    def rank_fn(group):
        buffer = reference_buffer(group, case)
        with jax.default_device(jax.devices("cpu")[group.rank]):
            active = jnp.asarray(case.actives[group.rank])
            _, _, _, returned = epj.dispatch(buffer, jnp.asarray(case.xs[group.rank]),
                                             jnp.asarray(case.topk_idxs[group.rank]), active, case.num_max_tokens,
                                             case.num_experts, use_fp8=False)
            return np.asarray(active), np.asarray(returned)

    dispatched, _ = expected(case, FLAGS["bf16"])
    for rank, (passed, returned) in enumerate(spawn(2, rank_fn)):
        np.testing.assert_array_equal(passed, case.actives[rank])
        np.testing.assert_array_equal(returned, dispatched[rank].active_ranks)
    assert list(dispatched[1].active_ranks) == [0, 1]  # the case exercises a change


def test_a_rank_without_tokens_keeps_its_ops_under_jit():
    """XLA replaces a result of no elements by a constant: a rank with no tokens this step (x of shape
    [0, H]) would lose its combine, whose combined_x is empty, and the dispatch feeding it, from its
    jitted program alone (in the forward and in the gradient), and its peers would wait for it (here
    the reference's collectives time out). The layer returns only what a model uses."""
    case = make_case(3, num_tokens=[4, 0])
    flags = FLAGS["bf16"]
    cpu_devices(2)

    def rank_fn(group):
        buffer = reference_buffer(group, case)
        grad_buffer = reference_buffer(group, case, epj.grad_buffer_size_hint(
            case.num_max_tokens, case.hidden, case.num_ranks, case.num_experts, case.num_topk))
        rank = group.rank

        def layer(x, weights, topk, active):
            recv, _, handle, active = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                                   **flags)
            combined, _ = epj.combine(buffer, expert_fn(rank, recv, flags), topk, weights, active, handle,
                                      grad_buffer=grad_buffer)
            return combined

        def loss(x, weights, topk, active):
            return jnp.sum(layer(x, weights, topk, active).astype(jnp.float32) ** 2)

        with jax.default_device(jax.devices("cpu")[rank]):
            args = [jnp.asarray(a) for a in (case.xs[rank], case.weights[rank], case.topk_idxs[rank],
                                              case.actives[rank])]
            combined = np.asarray(jax.jit(layer)(*args))
            grads = [jax.tree_util.tree_map(np.asarray, grad(*args)) for grad in
                     (jax.jit(jax.grad(loss, argnums=(0, 1))), jax.grad(loss, argnums=(0, 1)))]
        return combined, grads

    _, want = expected(case, flags)
    for rank, (combined, (jitted, eager)) in enumerate(spawn(2, rank_fn)):
        np.testing.assert_array_equal(bits(combined), bits(want[rank][0]), err_msg=f"rank {rank}: combined")
        for got, ref, name in zip(jitted, eager, ("x", "topk_weights")):
            assert got.shape == ref.shape == (case.xs[rank].shape[0], case.hidden if name == "x" else case.num_topk)
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64), rtol=2.0**-7,
                                       atol=1e-6, err_msg=f"rank {rank}: gradient of {name}, jit against eager")


def test_ranks_with_different_topk_differentiate_with_grad_num_topk():
    """Rank 1 routes top-1 where rank 0 routes top-2: with grad_num_topk=2 on both, the gradients equal
    those of rank 1 routing top-2 with a second entry of -1 and weight 0 (which adds nothing)."""
    T, H, E = 4, 128, 4
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((T, H)).astype(np.float32).astype(jnp.bfloat16) for _ in range(2)]
    topk0 = np.array([rng.permutation(E)[:2] for _ in range(T)], np.int32)
    topk1 = rng.integers(0, E, (T, 1)).astype(np.int32)
    w0, w1 = rng.uniform(0.5, 1.5, (T, 2)).astype(np.float32), rng.uniform(0.5, 1.5, (T, 1)).astype(np.float32)
    padded = ([topk0, topk1], [w0, w1]), ([topk0, np.pad(topk1, ((0, 0), (0, 1)), constant_values=-1)],
                                          [w0, np.pad(w1, ((0, 0), (0, 1)))])
    cpu_devices(2)

    def rank_fn(group):
        rank = group.rank
        buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(T, H, 2, E), backend="reference")
        grad_buffer = ep.Buffer(group, epj.grad_buffer_size_hint(T, H, 2, E, 2), backend="reference")
        grads = []
        for (topks, weights), grad_num_topk in zip(padded, (2, None)):
            def loss(x, w):
                active = jnp.ones(2, jnp.int32)
                recv, _, handle, active = epj.dispatch(buffer, x, topks[rank], active, T, E, use_fp8=False)
                y = (recv.astype(jnp.float32) * (rank + 2)).astype(jnp.bfloat16)
                out, _ = epj.combine(buffer, y, topks[rank], w, active, handle, grad_buffer=grad_buffer,
                                     grad_num_topk=grad_num_topk)
                return jnp.sum(out.astype(jnp.float32) ** 2)

            with jax.default_device(jax.devices("cpu")[rank]):
                grad_x, grad_w = jax.grad(loss, argnums=(0, 1))(jnp.asarray(xs[rank]), jnp.asarray(weights[rank]))
            grads.append((np.asarray(grad_x, np.float32), np.asarray(grad_w)))

        # Without grad_num_topk each rank lays the gradient's dispatch out for its own top-k: refused
        # on every rank, naming the argument.
        def loss_without(x, w):
            active = jnp.ones(2, jnp.int32)
            recv, _, handle, active = epj.dispatch(buffer, x, padded[0][0][rank], active, T, E, use_fp8=False)
            out, _ = epj.combine(buffer, recv, padded[0][0][rank], w, active, handle, grad_buffer=grad_buffer)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        with jax.default_device(jax.devices("cpu")[rank]), pytest.raises(Exception) as refused:
            jax.block_until_ready(jax.grad(loss_without, argnums=(0, 1))(jnp.asarray(xs[rank]),
                                                                         jnp.asarray(padded[0][1][rank])))
        return grads, str(refused.value)

    for rank, (((mixed_x, mixed_w), (padded_x, padded_w)), refusal) in enumerate(spawn(2, rank_fn)):
        np.testing.assert_array_equal(mixed_x, padded_x, err_msg=f"rank {rank}: gradient of x")
        np.testing.assert_array_equal(mixed_w, padded_w[:, :mixed_w.shape[1]], err_msg=f"rank {rank}: weights")
        assert np.abs(mixed_x).sum() > 0 and np.abs(mixed_w).sum() > 0
        assert "disagree on num_max_dispatch_tokens_per_rank" in refusal and "grad_num_topk=" in refusal, refusal


# --- shard_map: one device per rank, one program ------------------------------------------------------


def sharded(mesh, arrays):
    return jax.device_put(np.concatenate(arrays), NamedSharding(mesh, P("ep")))


@pytest.mark.parametrize("flag_id", ["bf16", "fp8-ue8m0"])
def test_shard_map_equals_reference(flag_id):
    flags = FLAGS[flag_id]
    num_ranks = 4
    devices = cpu_devices(num_ranks)
    # shard_map splits evenly: every rank has T tokens (the -1 entries still vary the counts).
    case = make_case(3, num_ranks=num_ranks, num_experts=8, num_topk=3, num_tokens=[4] * num_ranks)
    buffers = epj.make_buffers(devices, case.size_hint)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, topk, weights, active):
        recv, count, handle, active = epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts,
                                                   **flags)
        rank = jax.lax.axis_index("ep")
        y = jax.lax.switch(rank, [functools.partial(expert_fn, r, flags=flags) for r in range(num_ranks)], recv)
        combined, active = epj.combine(buffers, y, topk, weights, active, handle)
        return recv, count, combined, active

    recv, count, combined, active = step(*(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.weights,
                                                                       case.actives)))
    dispatched, want = expected(case, flags)
    num_local, tokens = case.num_local_experts, case.num_max_tokens
    for rank in range(num_ranks):
        mine = slice(rank * num_local, (rank + 1) * num_local)
        rank_recv = (recv[0][mine], recv[1][mine]) if flags["use_fp8"] else recv[mine]
        check_rank(rank, dispatched[rank], rank_recv, count[mine], flags)
        np.testing.assert_array_equal(bits(combined[rank * tokens:(rank + 1) * tokens]), bits(want[rank][0]),
                                      err_msg=f"rank {rank}: combined")
        np.testing.assert_array_equal(np.asarray(active)[rank * num_ranks:(rank + 1) * num_ranks], want[rank][1])
    epj.destroy_buffers(buffers)


def test_shard_map_needs_jit_and_a_refusal_on_one_device_raises_on_every_device_at_once():
    """Rank 1's ids are bad (out of range in its dispatch, then naming other experts in its combine): its
    op sends its refusal through the exchange, so rank 0's op raises with it at once, no device counts
    the call, and the next step of the same program equals the reference. (Raised before the exchange,
    the refusal held rank 0 there until the group's timeout, 30 s here, and broke the group.)"""
    devices = cpu_devices(2)
    flags = FLAGS["bf16"]
    case = make_case(14, num_ranks=2, num_experts=4, num_topk=1, num_tokens=[4, 4])
    buffers = epj.make_buffers(devices, case.size_hint, timeout_s=GROUP_TIMEOUT_S)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))

    def step(x, topk, combine_topk, weights, active):
        recv, count, handle, active = epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts,
                                                   **flags)
        rank = jax.lax.axis_index("ep")
        y = jax.lax.switch(rank, [functools.partial(expert_fn, r, flags=flags) for r in range(2)], recv)
        combined, active = epj.combine(buffers, y, combine_topk, weights, active, handle)
        return recv, count, combined, active

    sharded_step = functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))(step)
    good = [sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.topk_idxs, case.weights, case.actives)]
    with pytest.raises(TypeError, match=r"mooncake_ep.jax.dispatch: shard_map outside jax.jit is not supported .* "
                                        r"put jax.jit around the shard_map"):
        sharded_step(*good)
    jitted = jax.jit(sharded_step)
    numbers = [jax_ops._dispatch_numbers.get(buffer, [0, 0]).copy() for buffer in buffers.values()]
    out_of_range = sharded(mesh, [case.topk_idxs[0], np.full_like(case.topk_idxs[1], case.num_experts)])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_idx entries must be -1 or in \[0, 4\), got 4"):
        jax.block_until_ready(jitted(good[0], out_of_range, *good[2:]))
    assert [jax_ops._dispatch_numbers.get(buffer, [0, 0]) for buffer in buffers.values()] == numbers
    other_experts = sharded(mesh, [case.topk_idxs[0], (case.topk_idxs[1] + 1) % case.num_experts])
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"topk_idx must name the experts given to the dispatch of "
                                                          r"handle"):
        jax.block_until_ready(jitted(*good[:2], other_experts, *good[3:]))
    recv, count, combined, active = jitted(*good)
    dispatched, want = expected(case, flags)
    for rank in range(2):
        local, tokens = slice(rank * 2, (rank + 1) * 2), slice(rank * 4, (rank + 1) * 4)
        check_rank(rank, dispatched[rank], recv[local], count[local], flags)
        np.testing.assert_array_equal(bits(combined[tokens]), bits(want[rank][0]), err_msg=f"rank {rank}: combined")
        np.testing.assert_array_equal(np.asarray(active)[rank * 2:(rank + 1) * 2], want[rank][1])
    epj.destroy_buffers(buffers)


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_an_eager_refusal_on_one_rank_raises_on_every_rank_at_once(phase):
    """One rank per thread, eager ops: rank 1's ids are bad. Its eager check raises the ValueError as
    itself, but only once its op has refused them through the exchange, where rank 0's op waited for it
    until the group's timeout (30 s here) and then broke the group; rank 0's op raises with rank 1's
    reason at once, and a following step equals the reference on both ranks."""
    cpu_devices(2)
    flags = FLAGS["bf16"]
    case = make_case(15, num_ranks=2, num_experts=4, num_topk=2)
    own = {"dispatch": r"topk_idx entries must be -1 or in \[0, 4\), got 4",
           "combine": r"topk_idx must name the experts given to the dispatch of handle"}[phase]

    def rank_fn(group):
        rank = group.rank
        buffer = reference_buffer(group, case)
        with jax.default_device(jax.devices("cpu")[rank]):
            x, topk, weights, active = (jnp.asarray(a) for a in (case.xs[rank], case.topk_idxs[rank],
                                                                  case.weights[rank], case.actives[rank]))
            if phase == "dispatch":
                bad = topk.at[0, 0].set(case.num_experts) if rank == 1 else topk
                call = functools.partial(epj.dispatch, buffer, x, bad, active, case.num_max_tokens,
                                         case.num_experts, **flags)
            else:
                bad = topk.at[0, 0].set((topk[0, 0] + 1) % case.num_experts) if rank == 1 else topk
                recv, _, handle, _ = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                                  **flags)
                call = functools.partial(epj.combine, buffer, expert_fn(rank, recv, flags), bad, weights, active,
                                         handle)
            # After a good call of the same shapes the bad one runs the cached program, whose callback's
            # error JAX 0.10 raises as a ValueError wrapping it (a fresh one's as a JaxRuntimeError):
            # rank 1 still gets its own, both times.
            jax.block_until_ready(call.func(*call.args[:2], topk, *call.args[3:], **call.keywords))
            for _ in range(2):
                if rank == 1:
                    with pytest.raises(ValueError, match=rf"^mooncake_ep\.jax\.{phase}: {own}"):
                        call()
                else:
                    with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                                       match=rf"mooncake_ep\.jax\.{phase}: rank 1 of 2 refused this call, so no rank "
                                             rf"made it .*{own}"):
                        jax.block_until_ready(call())
        return rank_step(buffer, case, rank, flags, jit=False)

    results = ep.LocalGroup(2, timeout_s=GROUP_TIMEOUT_S).spawn(rank_fn)
    dispatched, combined = expected(case, flags)
    for rank, (recv, count, out, active) in enumerate(results):
        check_rank(rank, dispatched[rank], recv, count, flags)
        np.testing.assert_array_equal(bits(out), bits(combined[rank][0]), err_msg=f"rank {rank}: combined")


def test_an_eager_refusal_does_not_hide_that_the_exchange_failed():
    """Rank 0 never makes the call; rank 1's eager call with bad ids waits in the exchange until the
    group's timeout. That failure (the group is broken now) is what rank 1 gets, its own refusal added
    as a note: raising only the refusal hid it, and rank 1's next call met a broken group unwarned."""
    cpu_devices(2)
    flags = FLAGS["bf16"]
    case = make_case(15, num_ranks=2, num_experts=4, num_topk=2)

    def rank_fn(group):
        buffer = reference_buffer(group, case)
        if group.rank == 0:
            return None
        with jax.default_device(jax.devices("cpu")[1]):
            x, topk, active = (jnp.asarray(a) for a in (case.xs[1], case.topk_idxs[1], case.actives[1]))
            with pytest.raises((jax.errors.JaxRuntimeError, ValueError),
                               match=r"mooncake_ep\.jax\.dispatch: the exchange with the other ranks failed") as info:
                jax.block_until_ready(epj.dispatch(buffer, x, topk.at[0, 0].set(case.num_experts), active,
                                                   case.num_max_tokens, case.num_experts, **flags))
        return getattr(info.value, "__notes__", [])

    _, notes = ep.LocalGroup(2, timeout_s=1.0).spawn(rank_fn)
    assert ("(this rank's own check had refused the call: mooncake_ep.jax.dispatch: topk_idx entries must be -1 or "
            "in [0, 4), got 4 at (0, 0))") in notes, notes  # (JAX adds a note of its own)


def test_a_mesh_in_another_order_than_the_buffers_is_refused_on_every_rank_at_once():
    """The mesh position is the rank the program's data assumes; the device's Buffer must have it. Every
    rank's position goes with the exchange, so ranks whose device is where it belongs (0 and 3 here)
    fail with the others, with the whole picture, instead of waiting for them until a timeout."""
    num_ranks = 4
    devices = cpu_devices(num_ranks)
    case = make_case(5, num_ranks=num_ranks, num_experts=8, num_topk=2, num_tokens=[4] * num_ranks)
    buffers = epj.make_buffers(devices, case.size_hint)
    order = [devices[0], devices[2], devices[1], devices[3]]
    mesh = jax.sharding.Mesh(np.array(order), ("ep",))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, topk, active):
        return epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)[1]

    with pytest.raises(jax.errors.JaxRuntimeError, match=r"mooncake_ep.jax.dispatch: the shard_map's mesh does not put "
                                                          r"each rank's device at the rank's position \(mesh positions "
                                                          r"by rank: rank 0: 0, rank 1: 2, rank 2: 1, rank 3: 3\)"):
        jax.block_until_ready(step(*(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.actives))))
    epj.destroy_buffers(buffers)


def test_one_buffer_inside_a_shard_map_over_several_devices_is_refused_at_trace_time():
    """Each device of the shard_map is its own rank: one Buffer there would run every device's op as
    that one rank (on the CPU silently, with the last step's data). So would a grad_buffer that does
    not serve the forward's devices."""
    devices = cpu_devices(2)
    case, grad_size = grad_case(13, 2)
    buffers, grad_buffers = epj.make_buffers(devices, case.size_hint), epj.make_buffers(devices, grad_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    args = [sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.weights, case.actives)]

    def step(buffer, grad_buffer):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        def run(x, topk, w, active):
            recv, _, handle, active = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                                   use_fp8=False)
            return epj.combine(buffers, recv, topk, w, active, handle, grad_buffer=grad_buffer)[0]
        return run(*args)

    with pytest.raises(ValueError, match=r"mooncake_ep.jax.dispatch: one Buffer inside a shard_map over 2 devices; "
                                         r"each device is its own rank: pass the mapping"):
        step(buffers[devices[0]], None)
    with pytest.raises(ValueError, match=r"mooncake_ep.jax.combine: grad_buffer must serve the devices buffer serves, "
                                         r"each with the same rank .*: buffer is a mapping over cpu:\d \(rank 0\), "
                                         r"cpu:\d \(rank 1\), grad_buffer one Buffer"):
        step(buffers, grad_buffers[devices[1]])
    others = epj.make_buffers(cpu_devices(4)[2:], grad_size)
    with pytest.raises(ValueError, match=r"grad_buffer a mapping over cpu:2 \(rank 0\), cpu:3 \(rank 1\)"):
        step(buffers, others)
    swapped = dict(zip(devices, reversed([grad_buffers[d] for d in devices])))  # rank 1's on rank 0's device
    with pytest.raises(ValueError, match=r"grad_buffer a mapping over cpu:\d \(rank 1\), cpu:\d \(rank 0\)"):
        step(buffers, swapped)
    four = epj.make_buffers(cpu_devices(4), case.size_hint)  # a group of 4 ranks, a mesh of 2 of them
    with pytest.raises(ValueError, match=r"mooncake_ep.jax.dispatch: the shard_map runs on 2 devices, the Buffers' "
                                         r"group has 4 ranks; every rank takes part in each call"):
        step(four, None)
    combined = step(buffers, grad_buffers)  # the Buffers still work
    want = reference_step(case, dict(use_fp8=False), lambda rank, res, flags: res.recv_x)[1]
    np.testing.assert_array_equal(bits(combined), bits(np.concatenate([c for c, _ in want])))
    for mapping in (buffers, grad_buffers, others, four):
        epj.destroy_buffers(mapping)


def test_a_mesh_device_without_a_buffer_is_refused_before_any_rank_runs():
    """A mesh of as many devices as the group has ranks, one of them not the mapping's: that device's op
    has no Buffer. Refused when the program is lowered (the mesh is known there), not by that device's
    op when it runs, while the device that has one waits for it in the exchange until the group's
    timeout and the group is broken."""
    devices = cpu_devices(3)
    case = make_case(14, num_ranks=2, num_experts=4, num_topk=1, num_tokens=[4, 4])
    buffers = epj.make_buffers(devices[:2], case.size_hint, timeout_s=2.0)

    def run(mesh, abstract=False):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=mesh.abstract_mesh if abstract else mesh, in_specs=P("ep"),
                           out_specs=P("ep"))
        def step(x, topk, active):
            return epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)[1]

        return jax.block_until_ready(step(*(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.actives))))

    with pytest.raises(ValueError, match=r"^mooncake_ep.jax.dispatch: in the shard_map's mesh: no Buffer for cpu:2; "
                                         r"the mapping has cpu:0, cpu:1"):
        run(jax.sharding.Mesh(np.array([devices[0], devices[2]]), ("ep",)))
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("ep",))
    dispatched, _ = expected(case, FLAGS["bf16"])
    # Nothing ran: the group is whole. An abstract mesh lowers without devices, and is not refused for
    # it (its .devices raised JAX's own ValueError there, review): the callbacks check where they run.
    for abstract in (False, True):
        counts = run(mesh, abstract)
        np.testing.assert_array_equal(np.asarray(counts), np.concatenate([d.recv_count for d in dispatched]))
    epj.destroy_buffers(buffers)


def test_a_mesh_of_two_axes_is_the_callers_layout():
    """Over several axes the experts may be sharded in either axis order: nothing is refused."""
    devices = cpu_devices(4)
    case = make_case(9, num_ranks=4, num_experts=8, num_topk=2, num_tokens=[4] * 4)
    buffers = epj.make_buffers(np.array(devices).reshape(2, 2).T.flat, case.size_hint)  # ranks down ("ep", "dp")
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("dp", "ep"))
    spec = P(("ep", "dp"))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
    def step(x, topk, active):
        return epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)[1]

    put = lambda arrays: jax.device_put(np.concatenate(arrays), NamedSharding(mesh, spec))  # noqa: E731
    counts = np.asarray(step(put(case.xs), put(case.topk_idxs), put(case.actives)))
    actives = [np.ones(4, np.int32)] * 4
    want = [reference.dispatch(r, case.xs, case.topk_idxs, actives, case.num_max_tokens, case.num_experts,
                               use_fp8=False).recv_count for r in range(4)]
    np.testing.assert_array_equal(counts, np.concatenate(want))
    epj.destroy_buffers(buffers)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_arrays_spread_over_devices_outside_shard_map_are_refused(jit):
    """Outside shard_map XLA would run the op on every device with the whole array: every rank sending every token."""
    num_ranks = 2
    devices = cpu_devices(num_ranks)
    case = make_case(6, num_ranks=num_ranks, num_experts=4, num_topk=2, num_tokens=[2] * num_ranks)
    buffers = epj.make_buffers(devices, case.size_hint)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    call = functools.partial(epj.dispatch, buffers, num_max_dispatch_tokens_per_rank=case.num_max_tokens,
                             num_experts=case.num_experts, use_fp8=False)
    if jit:
        call = jax.jit(call)
    with pytest.raises(ValueError, match=r"mooncake_ep.jax.dispatch: x is spread over 2 devices outside shard_map, "
                                         r"and each call is one rank's; run it inside jax.shard_map"):
        call(*(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.actives)))
    epj.destroy_buffers(buffers)


def test_a_program_sharded_over_devices_outside_shard_map_is_refused_when_lowered():
    """jit's in_shardings spread the arrays without the tracers saying so: XLA would have run the op on
    both devices with every token (helper-118: every row received twice). The lowering refuses it, and
    the Buffers still work in a shard_map."""
    num_ranks = 2
    devices = cpu_devices(num_ranks)
    case = make_case(6, num_ranks=num_ranks, num_experts=4, num_topk=2, num_tokens=[2] * num_ranks)
    buffers = epj.make_buffers(devices, case.size_hint)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    spread = NamedSharding(mesh, P("ep"))
    call = functools.partial(epj.dispatch, buffers, num_max_dispatch_tokens_per_rank=case.num_max_tokens,
                             num_experts=case.num_experts, use_fp8=False)
    arrays = [jnp.asarray(np.concatenate(a)) for a in (case.xs, case.topk_idxs)] + [jnp.ones(num_ranks, jnp.int32)]
    with pytest.raises(ValueError, match=r"^mooncake_ep.jax.dispatch: the jitted program runs on 2 devices outside "
                                         r"shard_map .* run it inside jax.shard_map"):
        jax.jit(call, in_shardings=(spread, spread, None))(*arrays)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, topk, active):
        return call(x, topk, active)[1]

    count = step(*(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.actives)))
    dispatched, _ = expected(case, FLAGS["bf16"])
    np.testing.assert_array_equal(np.asarray(count), np.concatenate([d.recv_count for d in dispatched]))
    epj.destroy_buffers(buffers)


@pytest.mark.parametrize("form", ["dispatch", "dispatch_send"])
def test_a_buffer_used_by_eager_ops_lives_until_destroy_buffers(form):
    """JAX's caches keep the programs traced with a Buffer, which may replay its launches without
    calling back: the Buffer lives while they do (held weakly, it was collected under a cached program,
    helper-121), and destroy_buffers, which clears them, releases it."""
    import gc
    import weakref

    case = make_case(21, num_ranks=1)
    buffers = epj.make_buffers(cpu_devices(1), case.size_hint)
    (buffer,) = buffers.values()
    x, topk, active = (jnp.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.actives))
    result = getattr(epj, form)(buffer, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)
    if form == "dispatch_send":
        result = epj.dispatch_recv([result])
    jax.block_until_ready(jax.tree_util.tree_leaves(result))
    held = weakref.ref(buffer)
    del buffer, result
    gc.collect()
    assert held() is not None, "collected while JAX's caches hold programs traced with it"
    epj.destroy_buffers(buffers)
    del buffers
    gc.collect()
    assert held() is None, "destroy_buffers left the Buffer alive"


def test_a_numpy_masked_array_is_refused_by_name():
    """JAX's own refusal named neither the call nor the argument."""
    case, buffer, (x, topk, active) = one_rank()
    masked = np.ma.masked_array(np.asarray(topk), mask=np.zeros(topk.shape, bool))
    with pytest.raises(TypeError, match=r"^mooncake_ep.jax.dispatch: topk_idx is a numpy masked array"):
        epj.dispatch(buffer, x, masked, active, case.num_max_tokens, case.num_experts, use_fp8=False)


@pytest.mark.parametrize("form", ["dispatch", "dispatch_send"])
def test_an_eager_dispatch_names_num_experts_before_reading_the_ids_against_it(form):
    """num_experts=3 on 2 ranks (meant: 4): the ids were read against it first, and an id of 3 blamed
    eagerly, where jit named num_experts."""
    case = make_case(22, num_ranks=2, num_experts=4)
    buffer = spawn(2, lambda g: reference_buffer(g, case))[0]
    x, topk, active = (jnp.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.actives))
    topk = topk.at[0, 0].set(3)
    call = functools.partial(getattr(epj, form), buffer, x, topk, active, case.num_max_tokens, 3, use_fp8=False)
    pattern = rf"^mooncake_ep\.jax\.{form}: num_experts must be a multiple of num_ranks=2, got 3"
    with pytest.raises(ValueError, match=pattern):
        call()
    if form == "dispatch":
        with pytest.raises(ValueError, match=pattern):
            jax.jit(call)()


# --- the split form: every rank in one program on one device -------------------------------------------


def split_step(buffers, case: Case, flags: dict, ranks=None):
    ranks = list(range(case.num_ranks)) if ranks is None else ranks

    @jax.jit
    def step(xs, topks, weights, actives):
        sent = [epj.dispatch_send(buffers[r], xs[i], topks[i], actives[i], case.num_max_tokens, case.num_experts,
                                  **flags) for i, r in enumerate(ranks)]
        received = epj.dispatch_recv(sent)
        sent = [epj.combine_send(buffers[r], expert_fn(r, recv, flags), topks[i], weights[i], active, handle)
                for i, (r, (recv, _, handle, active)) in enumerate(zip(ranks, received))]
        return received, epj.combine_recv(sent)

    pick = lambda arrays: [jnp.asarray(arrays[r]) for r in ranks]  # noqa: E731
    received, combined = step(pick(case.xs), pick(case.topk_idxs), pick(case.weights), pick(case.actives))
    return [(r[0], r[1], r[3]) for r in received], combined


@pytest.mark.parametrize("flag_id", ["bf16", "fp8", "fp8-ue8m0"])
def test_split_form_in_one_program_equals_reference(flag_id):
    flags = FLAGS[flag_id]
    case = make_case(4, num_ranks=3, num_experts=6, num_topk=2, num_tokens=[4, 2, 0])
    buffers = spawn(3, lambda g: reference_buffer(g, case))
    received, combined = split_step(buffers, case, flags)
    dispatched, want = expected(case, flags)
    for rank in range(3):
        recv, count, active = received[rank]
        check_rank(rank, dispatched[rank], recv, count, flags)
        np.testing.assert_array_equal(active, dispatched[rank].active_ranks)
        np.testing.assert_array_equal(bits(combined[rank][0]), bits(want[rank][0]), err_msg=f"rank {rank}")
        np.testing.assert_array_equal(combined[rank][1], want[rank][1])


def test_split_form_without_a_rank_masks_it():
    """A rank of the group that sends nothing is masked by the others, as a dead rank is on the GPU."""
    case = make_case(5, num_ranks=3, num_experts=6, num_tokens=[4, 3, 4])
    buffers = spawn(3, lambda g: reference_buffer(g, case))
    received, _ = split_step(buffers, case, FLAGS["bf16"], ranks=[0, 2])
    xs = [case.xs[0], None, case.xs[2]]
    topks = [case.topk_idxs[0], None, case.topk_idxs[2]]
    for index, rank in enumerate([0, 2]):
        want = reference.dispatch(rank, xs, topks, case.actives, case.num_max_tokens, case.num_experts,
                                  use_fp8=False)
        recv, count, active = received[index]
        check_rank(rank, want, recv, count, FLAGS["bf16"])
        np.testing.assert_array_equal(active, [1, 0, 1])


# --- gradients ------------------------------------------------------------------------------------------


def grad_case(seed: int, num_ranks: int):
    case = make_case(seed, num_ranks=num_ranks, num_max_tokens=4, hidden=128, num_experts=2 * num_ranks, num_topk=2,
                     num_tokens=[4] * num_ranks)
    grad_size = epj.grad_buffer_size_hint(case.num_max_tokens, case.hidden, num_ranks, case.num_experts,
                                          case.num_topk)
    return case, grad_size


def drop_copies_past_t_as_the_kernels_do(monkeypatch):
    """Lift the host check that refuses a rank's copies to one expert past its first T, so the CPU
    path drops them as the kernels do (reference.dispatch drops them; Buffer.dispatch documents both)."""
    from mooncake_ep import buffer as buffer_module
    from mooncake_ep.validation import check_expert_ids

    def range_only(where, topk_view, num_experts, num_max_tokens):
        check_expert_ids(where, topk_view, num_experts, np.iinfo(np.int32).max)

    monkeypatch.setattr(buffer_module, "check_expert_ids", range_only)
    monkeypatch.setattr(jax_ops, "check_expert_ids", range_only)  # the CPU callback's check, read in its module


@pytest.mark.parametrize("combine_drops", [False, True, "copies-past-T"],
                         ids=["same-ids", "combine-drops-entries", "copies-past-T"])
def test_gradients_of_dispatch_and_combine_match_float64(combine_drops, monkeypatch):
    """The vjp of each op against its float64 formula, with routing across 2 ranks (shard_map).
    combine_drops: combine's topk_idx is -1 at some entries the dispatch sent (they add nothing): their
    expert rows and weights get no gradient, and every other row still gets its own. "copies-past-T":
    rank 0 names expert 0 six times (T = 4) and the dispatch drops its last two copies, as the kernels
    do: only those get no gradient, expert 0's other rows (rank 1's too) still get theirs."""
    num_ranks = 2
    devices = cpu_devices(num_ranks)
    case, grad_size = grad_case(6, num_ranks)
    if combine_drops == "copies-past-T":
        drop_copies_past_t_as_the_kernels_do(monkeypatch)
        case.topk_idxs[0] = np.array([[0, 0], [0, 1], [0, 0], [2, 0]], np.int32)
        case.topk_idxs[1][0, 0] = 0  # rank 1's rows of expert 0 come after rank 0's
        assert (reference.expert_slots(case.topk_idxs[0], case.num_experts) >= case.num_max_tokens).sum() == 2
    combine_topks = [t.copy() for t in case.topk_idxs]
    if combine_drops is True:
        for t in combine_topks:
            t[::2, 0] = -1
        assert any(((t < 0) & (d >= 0)).any() for t, d in zip(combine_topks, case.topk_idxs))
    buffers = epj.make_buffers(devices, case.size_hint)
    grad_buffers = epj.make_buffers(devices, grad_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    T, E, K, H = case.num_max_tokens, case.num_experts, case.num_topk, case.hidden
    rng = np.random.default_rng(7)
    num_rows = num_ranks * T
    grad_recv = rng.standard_normal((num_ranks * case.num_local_experts, num_rows, H)).astype(BF16)
    expert_out = rng.standard_normal((num_ranks * case.num_local_experts, num_rows, H)).astype(BF16)
    grad_y = rng.standard_normal((num_ranks * T, H)).astype(BF16)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def vjps(x, topk, combine_topk, weights, active, grad_recv, expert_out, grad_y):
        # <op(...), cotangent> differentiated is the vjp of the op applied to the cotangent (bf16 cotangents
        # survive the float32 products exactly).
        def dispatched(x):
            recv, count, handle, _ = epj.dispatch(buffers, x, topk, active, T, E, use_fp8=False)
            return jnp.sum(recv.astype(jnp.float32) * grad_recv.astype(jnp.float32)), (count, handle)

        grad_x, (count, handle) = jax.grad(dispatched, has_aux=True)(x)

        def combined(y, w):
            out, _ = epj.combine(buffers, y, combine_topk, w, active, handle, grad_buffer=grad_buffers)
            return jnp.sum(out.astype(jnp.float32) * grad_y.astype(jnp.float32))

        grad_expert_out, grad_w = jax.grad(combined, argnums=(0, 1))(expert_out, weights)
        return count, grad_x, grad_expert_out, grad_w

    count, grad_x, grad_expert_out, grad_w = vjps(
        *(sharded(mesh, a) for a in (case.xs, case.topk_idxs, combine_topks, case.weights, case.actives)),
        *(sharded(mesh, np.split(a, num_ranks)) for a in (grad_recv, expert_out, grad_y)))
    dispatched = [reference.dispatch(r, case.xs, case.topk_idxs, case.actives, T, E, use_fp8=False)
                  for r in range(num_ranks)]
    num_local = case.num_local_experts
    grad_recv64 = grad_recv.astype(np.float64)
    expert_out64 = expert_out.astype(np.float64)
    for rank, res in enumerate(dispatched):
        mine = slice(rank * num_local, (rank + 1) * num_local)
        np.testing.assert_array_equal(np.asarray(count)[mine], res.recv_count)
        # dispatch: grad_x[t] = sum_k grad_recv[row(t, k)] over the ranks holding (t, k); summed in fp32,
        # rounded once to bf16: within one bf16 rounding (2^-8 relative) of the float64 sum.
        want_x = np.zeros((T, H))
        want_eo = np.zeros((num_local, num_rows, H))
        want_w = np.zeros((T, K))
        for owner in range(num_ranks):
            for e in range(num_local):
                for row in range(dispatched[owner].recv_count[e]):
                    src, t, k = (int(a[e, row]) for a in (dispatched[owner].recv_src_rank,
                                                          dispatched[owner].recv_src_token,
                                                          dispatched[owner].recv_src_topk))
                    g_row = grad_recv64[owner * num_local + e, row]
                    if src == rank:
                        want_x[t] += g_row
                    if combine_topks[src][t, k] < 0:
                        continue
                    if src == rank:
                        want_w[t, k] = expert_out64[owner * num_local + e, row] @ grad_y.astype(np.float64)[
                            rank * T + t]
                    if owner == rank:
                        want_eo[e, row] = case.weights[src][t, k] * grad_y.astype(np.float64)[src * T + t]
        got_x = np.asarray(grad_x, np.float64)[rank * T:(rank + 1) * T]
        np.testing.assert_allclose(got_x, want_x, rtol=2.0**-8, atol=1e-6, err_msg=f"rank {rank}: grad x")
        # combine: grad of expert row (t, k) = w_k * grad_y[t] in bf16; rows past recv_count exactly 0.
        got_eo = np.asarray(grad_expert_out, np.float64)[mine]
        np.testing.assert_allclose(got_eo, want_eo, rtol=2.0**-8, atol=1e-6, err_msg=f"rank {rank}: grad expert_out")
        for e, n in enumerate(res.recv_count):
            assert not got_eo[e, n:].any(), f"rank {rank} expert {e}: rows past recv_count must get no gradient"
        # weights: an fp32 dot product of bf16 rows (H = 128 terms): fp32 accumulation error only.
        got_w = np.asarray(grad_w, np.float64)[rank * T:(rank + 1) * T]
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-4, err_msg=f"rank {rank}: grad topk_weights")
        assert np.all(got_w[combine_topks[rank] < 0] == 0), "no gradient for -1 entries"
    epj.destroy_buffers(buffers)
    epj.destroy_buffers(grad_buffers)


def test_the_combine_gradient_drops_the_copies_the_reference_drops():
    """The backward's routing leaves out exactly the copies past T that reference.dispatch drops (its
    expert_slots), whatever the ids: repeats, -1, ids outside [0, E)."""
    rng = np.random.default_rng(3)
    num_experts, T = 4, 3
    ids = rng.integers(-2, num_experts + 2, size=(6, 4)).astype(np.int32)
    want = np.where(reference.expert_slots(ids, num_experts) >= T, -1, ids)
    assert (want != ids).any() and ((ids < 0) | (ids >= num_experts)).any()
    np.testing.assert_array_equal(np.asarray(epj._drop_copies_past(jnp.asarray(ids), num_experts, T)), want)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_gradient_of_moe_layers_matches_the_dense_layers(num_layers):
    """jax.grad through dispatch -> per-expert matmul -> combine, against the same layers computed densely.

    Two layers share the Buffers (and parity 0) in one program: their forward and backward steps
    must stay paired on each Buffer, ordered by data alone.
    """
    num_ranks = 2
    devices = cpu_devices(num_ranks)
    case, grad_size = grad_case(8, num_ranks)
    buffers = epj.make_buffers(devices, case.size_hint)
    grad_buffers = epj.make_buffers(devices, grad_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    T, E, H = case.num_max_tokens, case.num_experts, case.hidden
    weights_all = jnp.asarray(np.random.default_rng(9).standard_normal((E, H, H)).astype(np.float32) / np.sqrt(H))

    def moe(x, topk, w, active, expert_weights):
        for _ in range(num_layers):
            recv, _, handle, active = epj.dispatch(buffers, x, topk, active, T, E, use_fp8=False)
            y = jnp.einsum("erh,ehk->erk", recv.astype(jnp.float32), expert_weights).astype(jnp.bfloat16)
            x, active = epj.combine(buffers, y, topk, w, active, handle, grad_buffer=grad_buffers)
        return jnp.sum(x.astype(jnp.float32) ** 2)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P("ep"), P("ep")),
                       out_specs=(P("ep"), P("ep"), P("ep")))
    def grads(x, topk, w, active, expert_weights):
        return jax.grad(moe, argnums=(0, 2, 4))(x, topk, w, active, expert_weights)

    def dense(x, topk, w, expert_weights):
        x = x.astype(jnp.float32)
        for _ in range(num_layers):
            ys = jnp.einsum("th,ehk->tek", x, expert_weights)
            picked = jnp.take_along_axis(ys, jnp.maximum(topk, 0)[:, :, None], axis=1)
            x = jnp.sum(jnp.where(topk[:, :, None] >= 0, w[:, :, None] * picked, 0), axis=1)
        return jnp.sum(x ** 2)

    g_x, g_w, g_experts = grads(*(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.weights, case.actives)),
                                jax.device_put(weights_all, NamedSharding(mesh, P("ep"))))
    x_all, topk_all, w_all = (jnp.asarray(np.concatenate(a)) for a in (case.xs, case.topk_idxs, case.weights))
    d_x, d_w, d_experts = jax.grad(dense, argnums=(0, 2, 3))(x_all, topk_all, w_all, weights_all)
    # The MoE path rounds recv_x, the expert outputs and the gradient rows to bf16: a few bf16 ulps.
    for got, want, name in ((g_x, d_x, "x"), (g_w, d_w, "topk_weights"), (g_experts, d_experts, "expert weights")):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=0.02 * scale, err_msg=f"grad {name}")
    epj.destroy_buffers(buffers)
    epj.destroy_buffers(grad_buffers)


def test_a_mask_changed_after_the_dispatch_gives_zero_gradients_never_misplaced():
    """Ranks 0 and 1 mask each other in combine (as a combine that timed out does), rank 2 masks nobody.
    The backward routes by combine's mask, so on ranks 0 and 1 the rows of the other move: every
    expert whose count then differs from the forward's gives zero gradients (its weights, its rows'
    topk_weights and their share of x) instead of other rows'; the others' gradients are exact."""
    num_ranks = 3
    devices = cpu_devices(num_ranks)
    case, grad_size = grad_case(11, num_ranks)
    T, H, E, num_local = case.num_max_tokens, case.hidden, case.num_experts, case.num_local_experts
    buffers, grad_buffers = epj.make_buffers(devices, case.size_hint), epj.make_buffers(devices, grad_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    combine_masks = [np.array(m, np.int32) for m in ([1, 0, 1], [0, 1, 1], [1, 1, 1])]
    expert_weights = np.random.default_rng(12).standard_normal((E, H, H)).astype(np.float32) / np.sqrt(H)

    def moe(x, topk, w, active, combine_active, experts):
        recv, _, handle, _ = epj.dispatch(buffers, x, topk, active, T, E, use_fp8=False)
        y = jnp.einsum("erh,ehk->erk", recv.astype(jnp.float32), experts).astype(jnp.bfloat16)
        out, _ = epj.combine(buffers, y, topk, w, combine_active, handle, grad_buffer=grad_buffers)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def grads(x, topk, w, active, combine_active, experts):
        return jax.grad(moe, argnums=(0, 2, 5))(x, topk, w, active, combine_active, experts)

    g_x, g_w, g_experts = (np.asarray(g, np.float32) for g in grads(
        *(sharded(mesh, a) for a in (case.xs, case.topk_idxs, case.weights, case.actives, combine_masks)),
        jax.device_put(expert_weights, NamedSharding(mesh, P("ep")))))
    # Which experts moved: those of a rank whose combine masked a source that sent them rows.
    forward = [reference.dispatch(r, case.xs, case.topk_idxs, case.actives, T, E, use_fp8=False)
               for r in range(num_ranks)]
    moved = np.zeros(E, bool)
    for owner, res in enumerate(forward):
        for e in range(num_local):
            sources = res.recv_src_rank[e, :res.recv_count[e]]
            moved[owner * num_local + e] = bool((combine_masks[owner][sources] == 0).any())
    assert moved.any() and not moved.all(), moved
    topk_all = np.concatenate(case.topk_idxs)
    source = np.repeat(np.arange(num_ranks), T)
    # The forward: (token of rank s, expert e) adds in iff s's combine keeps e's rank.
    live = (topk_all >= 0) & (np.stack(combine_masks)[source[:, None], np.maximum(topk_all, 0) // num_local] != 0)
    kept = jnp.asarray(live & ~moved[np.maximum(topk_all, 0)])  # the pairs whose gradient comes back

    def dense(x, w, experts):
        ys = jnp.einsum("th,ehk->tek", x.astype(jnp.float32), experts)
        picked = jnp.take_along_axis(ys, jnp.maximum(jnp.asarray(topk_all), 0)[:, :, None], axis=1)
        # Forward values of every live pair; derivatives through the kept ones only.
        picked = jnp.where(kept[:, :, None], picked, jax.lax.stop_gradient(picked))
        weights = jnp.where(kept, w, jax.lax.stop_gradient(w))
        return jnp.sum(jnp.sum(jnp.where(jnp.asarray(live)[:, :, None], weights[:, :, None] * picked, 0), axis=1) ** 2)

    d_x, d_w, d_experts = (np.asarray(g, np.float32) for g in jax.grad(dense, argnums=(0, 1, 2))(
        jnp.asarray(np.concatenate(case.xs)), jnp.asarray(np.concatenate(case.weights)), jnp.asarray(expert_weights)))
    assert not g_experts[moved].any() and not g_w[~np.asarray(kept)].any(), "moved experts: zero, not misplaced"
    for got, want, name in ((g_x, d_x, "x"), (g_w, d_w, "topk_weights"), (g_experts, d_experts, "expert weights")):
        np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max(), err_msg=f"grad {name}")
    epj.destroy_buffers(buffers)
    epj.destroy_buffers(grad_buffers)


def test_a_rank_back_in_combines_mask_gets_no_other_tokens_gradient():
    """The dispatch's mask has ranks 0 and 2 masking each other; combine's has ranks 1 and 2 instead.
    Expert 2 (rank 2's) had its 2 rows from rank 1; the gradient's dispatch brings it 2 rows from
    rank 0: the same count, other tokens. Every gradient through expert 2 is 0, not rank 1's given
    to rank 0 (review, helper-78), as is the forward (rank 2 and its peers masked each other)."""
    num_ranks, T, H, E = 3, 2, 128, 3
    devices = cpu_devices(num_ranks)
    buffers = epj.make_buffers(devices, ep.Buffer.get_ep_buffer_size_hint(T, H, num_ranks, E))
    grad_buffers = epj.make_buffers(devices, epj.grad_buffer_size_hint(T, H, num_ranks, E, 1))
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    topk = [np.array([[2], [2]], np.int32), np.array([[2], [2]], np.int32), np.array([[1], [1]], np.int32)]
    dispatch_masks = [np.array(m, np.int32) for m in ([1, 1, 0], [1, 1, 1], [0, 1, 1])]
    combine_masks = [np.array(m, np.int32) for m in ([1, 1, 1], [1, 1, 0], [1, 0, 1])]
    xs = [np.random.default_rng(13 + r).standard_normal((T, H)).astype(BF16) for r in range(num_ranks)]
    weights = [np.array(w, np.float32) for w in ([[2.0], [3.0]], [[5.0], [7.0]], [[1.0], [1.0]])]

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def grads(x, topk, w, dispatch_active, combine_active):
        recv, _, handle, _ = epj.dispatch(buffers, x, topk, dispatch_active, T, E, use_fp8=False)

        def loss(y, w):
            out, _ = epj.combine(buffers, y, topk, w, combine_active, handle, grad_buffer=grad_buffers)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1))(recv, w)

    g_y, g_w = (np.asarray(g, np.float32) for g in grads(
        *(sharded(mesh, a) for a in (xs, topk, weights, dispatch_masks, combine_masks))))
    assert not g_w.any(), "every token's weight: no gradient through expert 2 (nor through expert 1, masked)"
    assert not g_y.any(), "expert 2's rows: no gradient"
    epj.destroy_buffers(buffers)
    epj.destroy_buffers(grad_buffers)


@pytest.mark.parametrize("active_spec", ["per-rank", "replicated"])
def test_inputs_replicated_over_the_mesh_get_the_sum_of_every_ranks_gradient(active_spec):
    """x, topk_idx and topk_weights given whole to every device (in_specs P()): every rank dispatches the
    same tokens, so each replicated input's gradient is the sum of the ranks' (the transpose of the
    broadcast), which the dense layer computed R times over gives. With active_ranks replicated too
    every input is: the results still differ per rank, and are typed so."""
    num_ranks = 2
    devices = cpu_devices(num_ranks)
    case, grad_size = grad_case(15, num_ranks)
    T, H, E = case.num_max_tokens, case.hidden, case.num_experts
    buffers, grad_buffers = epj.make_buffers(devices, case.size_hint), epj.make_buffers(devices, grad_size)
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    x, topk, w = case.xs[0], case.topk_idxs[0], case.weights[0]
    expert_weights = np.random.default_rng(16).standard_normal((E, H, H)).astype(np.float32) / np.sqrt(H)

    def loss(x, topk, w, active, experts):
        recv, _, handle, active = epj.dispatch(buffers, x, topk, active, T, E, use_fp8=False)
        y = jnp.einsum("erh,ehk->erk", recv.astype(jnp.float32), experts).astype(jnp.bfloat16)
        out, _ = epj.combine(buffers, y, topk, w, active, handle, grad_buffer=grad_buffers)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    active_in = P("ep") if active_spec == "per-rank" else P()

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P(), active_in, P("ep")),
                       out_specs=(P(), P(), P("ep")))
    def grads(x, topk, w, active, experts):
        return jax.grad(loss, argnums=(0, 2, 4))(x, topk, w, active, experts)

    def dense(x, w, experts):
        ys = jnp.einsum("th,ehk->tek", x.astype(jnp.float32), experts)
        picked = jnp.take_along_axis(ys, jnp.maximum(jnp.asarray(topk), 0)[:, :, None], axis=1)
        out = jnp.sum(jnp.where(jnp.asarray(topk)[:, :, None] >= 0, w[:, :, None] * picked, 0), axis=1)
        return num_ranks * jnp.sum(out ** 2)

    active = sharded(mesh, case.actives) if active_spec == "per-rank" else case.actives[0]
    got = grads(x, topk, w, active, jax.device_put(expert_weights, NamedSharding(mesh, P("ep"))))
    want = jax.grad(dense, argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(w), jnp.asarray(expert_weights))
    for g, d, name in zip(got, want, ("x", "topk_weights", "expert weights")):
        g, d = np.asarray(g, np.float32), np.asarray(d, np.float32)
        np.testing.assert_allclose(g, d, atol=0.02 * np.abs(d).max(), err_msg=f"grad {name}")
    epj.destroy_buffers(buffers)
    epj.destroy_buffers(grad_buffers)


# --- refusals: clear errors naming the argument, and the buffer still works ------------------------------


def one_rank():
    case = make_case(10, num_ranks=1, num_experts=2, num_tokens=[3])
    buffer = spawn(1, lambda g: reference_buffer(g, case))[0]
    args = [jnp.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.actives)]
    return case, buffer, args


def test_float64_weights_are_refused_and_int64_ids_accepted():
    case, buffer, (x, topk, active) = one_rank()
    recv, _, handle, active = epj.dispatch(buffer, x, case.topk_idxs[0].astype(np.int64), active, case.num_max_tokens,
                                           case.num_experts, use_fp8=False)
    assert handle.config.num_topk == case.num_topk  # int64 numpy ids became int32 and were accepted
    with pytest.raises(TypeError, match=r"mooncake_ep.jax.combine: topk_weights is a float64 numpy array, which JAX "
                                        r"would cast silently; pass float32"):
        epj.combine(buffer, recv, topk, case.weights[0].astype(np.float64), active, handle)
    combined, _ = epj.combine(buffer, recv, topk, jnp.asarray(case.weights[0]), active, handle)
    assert combined.shape == (3, case.hidden)
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match=r"mooncake_ep.jax.combine: topk_weights must be float32, got float64"):
            epj.combine(buffer, recv, topk, jnp.asarray(case.weights[0], jnp.float64), active, handle)
        with pytest.raises(TypeError, match=r"mooncake_ep.jax.combine: topk_weights is a float64 numpy array; pass "
                                            r"float32"):  # x64 on: JAX would keep it, and nothing takes float64
            epj.combine(buffer, recv, topk, case.weights[0].astype(np.float64), active, handle)
        # with x64 on, int64 ids stay int64 and are accepted as such
        _, _, handle64, _ = epj.dispatch(buffer, x, jnp.asarray(case.topk_idxs[0], jnp.int64), active,
                                         case.num_max_tokens, case.num_experts, use_fp8=False)
        assert handle64.config.num_topk == case.num_topk


def test_a_handle_a_later_dispatch_at_its_parity_overwrote_is_refused_on_the_cpu():
    """A GPU combine reads the routing of its parity's last dispatch from the workspace, so a handle
    whose parity a later dispatch took would be combined on that dispatch's routing: the CPU callbacks,
    which run every call, refuse it (eagerly, under jit, and in the split form), before any exchange."""
    case, buffer, (x, topk, active) = one_rank()
    weights = jnp.asarray(case.weights[0])
    dispatch = lambda parity: epj.dispatch(buffer, x, topk, active, case.num_max_tokens,  # noqa: E731
                                           case.num_experts, use_fp8=False, parity=parity)
    first, second = dispatch(0), dispatch(0)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"mooncake_ep.jax.combine: handle is stale: it is dispatch #1 "
                                                         r"at parity 0 of this Buffer, and dispatch #2 at that parity"):
        jax.block_until_ready(epj.combine(buffer, first[0], topk, weights, active, first[2]))
    other = dispatch(1)  # the other half: the second's routing stays
    for recv, _, handle, _ in (second, other):
        combined, _ = epj.combine(buffer, recv, topk, weights, active, handle)
        assert combined.shape == (3, case.hidden)

    @jax.jit
    def two_dispatches_then_the_first_combine(x):
        recv, _, handle, mask = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                             use_fp8=False)
        _, _, _, mask = epj.dispatch(buffer, x, topk, mask, case.num_max_tokens, case.num_experts, use_fp8=False)
        return epj.combine(buffer, recv, topk, weights, mask, handle)[0]

    with pytest.raises(jax.errors.JaxRuntimeError, match=r"handle is stale"):
        jax.block_until_ready(two_dispatches_then_the_first_combine(x))

    pending = [epj.dispatch_send(buffer, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)]
    (recv, _, handle, _), = epj.dispatch_recv(pending)
    dispatch(0)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"mooncake_ep.jax.combine_recv: handle is stale"):
        jax.block_until_ready(epj.combine_recv([epj.combine_send(buffer, recv, topk, weights, active, handle)]))
    recv, _, handle, _ = dispatch(0)
    combined, _ = epj.combine(buffer, recv, topk, weights, active, handle)
    assert combined.shape == (3, case.hidden)


def _deleted(array):
    array.delete()  # what donate_argnums does to a jitted step's argument
    return array


@pytest.mark.parametrize("mutate,error,pattern", [
    (lambda a: a | dict(x=a["x"].astype(jnp.float32)), TypeError, r"mooncake_ep.jax.dispatch: x must be bfloat16, "
                                                                  r"got float32"),
    (lambda a: a | dict(x=jnp.zeros((3, 200), jnp.bfloat16)), ValueError,
     r"x\.shape\[1\] \(hidden\) must be a multiple of 128, got 200"),
    (lambda a: a | dict(topk_idx=a["topk_idx"].astype(jnp.float32)), TypeError,
     r"topk_idx must be int64 or int32, got float32"),
    (lambda a: a | dict(active_ranks=jnp.ones(2, jnp.int32)), ValueError,
     r"active_ranks must have shape \(1,\), got \(2,\)"),
    (lambda a: a | dict(num_max_dispatch_tokens_per_rank=2), ValueError, r"x has 3 tokens, more than"),
    (lambda a: a | dict(parity=2), ValueError, r"parity must be 0 or 1 \(the workspace half\), got 2"),
    (lambda a: a | dict(x=np.zeros((3, 256), np.float64)), TypeError,
     r"x is a float64 numpy array, which JAX would cast silently; pass bfloat16"),
    (lambda a: a | dict(topk_idx=np.zeros((3, 2), np.uint64)), TypeError,
     r"topk_idx is a uint64 numpy array, which JAX would turn into uint32 without a word; pass int32 \(int64 with"),
    # int64 is taken as ids only: Buffer.dispatch refuses an int64 active_ranks, and so does x64 mode
    (lambda a: a | dict(active_ranks=np.ones(1, np.int64)), TypeError,
     r"active_ranks is a int64 numpy array, which JAX would turn into int32 without a word; pass int32"),
    (lambda a: a | dict(x=np.zeros((3, 256), np.int64)), TypeError,
     r"x is a int64 numpy array, which JAX would turn into int32 without a word; pass bfloat16"),
    (lambda a: a | dict(active_ranks=np.ones(1, ">i4")), TypeError,
     r"mooncake_ep.jax.dispatch: active_ranks is a byte-swapped numpy array \(>i4\); pass native byte order"),
    # JAX's own errors named neither the call nor the argument (helper-148)
    (lambda a: a | dict(topk_idx=np.zeros((3, 2), object)), TypeError,
     r"mooncake_ep.jax.dispatch: topk_idx is a numpy array of \|O \(object\), which JAX cannot hold; pass int32"),
    (lambda a: a | dict(active_ranks=_deleted(jnp.ones(1, jnp.int32))), TypeError,
     r"mooncake_ep.jax.dispatch: active_ranks: this ArrayImpl was deleted \(donated to a jitted call, or "
     r"\.delete\(\)\); pass a live array"),
    (lambda a: a | dict(buffer=object()), TypeError, r"buffer must be a mooncake_ep.Buffer or a mapping"),
    (lambda a: a | dict(use_ue8m0=True), ValueError, r"use_ue8m0=True needs use_fp8=True and round_scale=True"),
    (lambda a: a | dict(command_buffer_compatible="no"), TypeError,
     r"mooncake_ep.jax.dispatch: command_buffer_compatible must be a bool, got str"),
    # with x64 off JAX would wrap 2**32 into expert 0
    (lambda a: a | dict(topk_idx=np.where(np.arange(6).reshape(3, 2) == 5, 2**32, np.zeros((3, 2), np.int64))),
     ValueError, r"topk_idx holds 4294967296 at \(2, 1\), outside int32, and with jax_enable_x64 off"),
], ids=["x-float32", "hidden", "topk-float", "active-shape", "too-many-tokens", "parity", "x-float64-numpy",
        "topk-uint64-numpy", "active-int64-numpy", "x-int64-numpy", "active-byte-swapped", "topk-object-numpy",
        "active-deleted", "not-a-buffer",
        "ue8m0-alone",
        "command-buffer-str", "int64-id-past-int32"])
def test_bad_dispatch_is_refused_at_trace_time_and_the_buffer_still_works(mutate, error, pattern):
    case, buffer, (x, topk, active) = one_rank()
    good = dict(buffer=buffer, x=x, topk_idx=topk, active_ranks=active,
                num_max_dispatch_tokens_per_rank=case.num_max_tokens, num_experts=case.num_experts)
    bad = mutate(dict(good))
    keywords = ("parity", "use_ue8m0", "command_buffer_compatible")
    call = lambda a: epj.dispatch(**{k: v for k, v in a.items() if k not in keywords},  # noqa: E731
                                  use_fp8=False, **{k: a[k] for k in keywords if k in a})
    with pytest.raises(error, match=pattern):
        call(bad)
    with pytest.raises(error, match=pattern):
        jax.jit(lambda: call(bad))()
    recv, count, _, _ = call(good)
    dispatched = reference.dispatch(0, case.xs, case.topk_idxs, case.actives, case.num_max_tokens, case.num_experts,
                                    use_fp8=False)
    check_rank(0, dispatched, recv, count, FLAGS["bf16"])


@pytest.mark.parametrize("ids,pattern", [
    ([[0, 2], [1, -1], [0, 1]], r"topk_idx entries must be -1 or in \[0, 2\), got 2 at \(0, 1\)"),
    ([[0, -2], [1, -1], [0, 1]], r"topk_idx entries must be -1 or in \[0, 2\), got -2 at \(0, 1\)"),
    ([[0, 0], [0, -1], [0, 1]], r"topk_idx sends 4 copies to expert 0, more than num_max_dispatch_tokens_per_rank=3"),
], ids=["past-E", "below-minus-one", "copies-past-T"])
@pytest.mark.parametrize("form", ["dispatch", "dispatch_send"])
def test_bad_cpu_ids_raise_valueerror_eagerly_and_the_buffer_still_works(ids, pattern, form):
    """Eager calls check the ids before the op: raised inside its callback, XLA wrapped the ValueError
    in a JaxRuntimeError. Under jit the values are unknown at trace time: the op raises when it runs."""
    case, buffer, (x, topk, active) = one_rank()
    call = getattr(epj, form)
    bad = jnp.asarray(np.array(ids, np.int32))
    num_max_tokens = 3  # the tokens x has
    with pytest.raises(ValueError, match=rf"^mooncake_ep\.jax\.{form}: {pattern}"):
        call(buffer, x, bad, active, num_max_tokens, case.num_experts, use_fp8=False)
    if form == "dispatch":
        with pytest.raises(jax.errors.JaxRuntimeError, match=pattern):
            jax.block_until_ready(jax.jit(lambda ids: call(buffer, x, ids, active, num_max_tokens,
                                                           case.num_experts, use_fp8=False))(bad))
    recv, count, _, _ = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)
    dispatched = reference.dispatch(0, case.xs, case.topk_idxs, case.actives, case.num_max_tokens, case.num_experts,
                                    use_fp8=False)
    check_rank(0, dispatched, recv, count, FLAGS["bf16"])


@pytest.mark.parametrize("flags,pattern", [
    (dict(renormalize="no"), r"mooncake_ep.jax.combine: renormalize must be a bool, got str"),
    (dict(renormalize=0), r"mooncake_ep.jax.combine: renormalize must be a bool, got int"),
    (dict(command_buffer_compatible=None), r"mooncake_ep.jax.combine: command_buffer_compatible must be a bool, "
                                           r"got NoneType"),
], ids=["renormalize-str", "renormalize-int", "command-buffer-none"])
def test_combine_flags_must_be_bools(flags, pattern):
    """As Buffer.combine's: renormalize="no" had been taken as true."""
    case, buffer, (x, topk, active) = one_rank()
    recv, _, handle, _ = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)
    with pytest.raises(TypeError, match=pattern):
        epj.combine(buffer, recv, topk, jnp.asarray(case.weights[0]), active, handle, **flags)


def test_dispatch_flags_must_be_bools_under_grad_too():
    """The gradient's refusal of fp8 reads use_fp8 first: a string must still be named as a bad flag."""
    case, buffer, (x, topk, active) = one_rank()

    def loss(x):
        recv = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8="no")[0]
        return jnp.sum(recv.astype(jnp.float32))

    with pytest.raises(TypeError, match=r"mooncake_ep.jax.dispatch: use_fp8 must be a bool, got str"):
        jax.grad(loss)(x)


def test_cpu_combine_refuses_ids_other_than_its_dispatchs():
    """As Buffer.combine on host arrays: the CPU handle carries its dispatch's ids; an entry naming
    another expert is refused (the kernels would read that expert's row), -1 adds nothing."""
    case = make_case(7, num_ranks=1, num_experts=4, num_topk=2)
    flags = FLAGS["bf16"]

    def rank_fn(group):
        buffer = reference_buffer(group, case)
        x, topk, weights, active = (jnp.asarray(a) for a in (case.xs[0], case.topk_idxs[0], case.weights[0],
                                                              case.actives[0]))
        recv, _, handle, active = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                               **flags)
        y = expert_fn(0, recv, flags)
        other = topk.at[0, 0].set((topk[0, 0] + 1) % case.num_experts)
        refused = (r"mooncake_ep\.jax\.combine: topk_idx must name the experts given to the dispatch of handle "
                   r"\(or -1\); entry \(0, 0\) is")
        with pytest.raises(ValueError, match=refused):  # eager: at once, as dispatch's bad ids are
            epj.combine(buffer, y, other, weights, active, handle)
        with pytest.raises(jax.errors.JaxRuntimeError, match=refused):  # under jit: by the op, when it runs
            jitted = jax.jit(lambda y, ids, w, a, h: epj.combine(buffer, y, ids, w, a, h))
            jax.block_until_ready(jitted(y, other, weights, active, handle))
        return np.asarray(epj.combine(buffer, y, topk, weights, active, handle)[0])

    (combined,) = spawn(1, rank_fn)
    np.testing.assert_array_equal(bits(combined), bits(expected(case, flags)[1][0][0]))

    buffers = spawn(1, lambda g: reference_buffer(g, case))  # the split form's receive half checks too
    x, topk, weights, active = (jnp.asarray(a) for a in (case.xs[0], case.topk_idxs[0], case.weights[0],
                                                          case.actives[0]))
    sent = epj.dispatch_send(buffers[0], x, topk, active, case.num_max_tokens, case.num_experts, **flags)
    ((recv, _, handle, active),) = epj.dispatch_recv([sent])
    other = topk.at[0, 1].set((topk[0, 1] + 1) % case.num_experts)
    y = expert_fn(0, recv, flags)
    with pytest.raises(ValueError, match=r"mooncake_ep\.jax\.combine_send: topk_idx must name the experts given to "
                                         r"the dispatch of handle"):
        epj.combine_send(buffers[0], y, other, weights, active, handle)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"mooncake_ep\.jax\.combine_recv: topk_idx must name the "
                                                          r"experts given to the dispatch of handle"):
        split = jax.jit(lambda y, ids, w, a, h: epj.combine_recv([epj.combine_send(buffers[0], y, ids, w, a, h)]))
        jax.block_until_ready(split(y, other, weights, active, handle))


def test_arrays_of_other_frameworks_and_foreign_handles_are_refused():
    torch = pytest.importorskip("torch")
    case, buffer, (x, topk, active) = one_rank()
    with pytest.raises(TypeError, match=r"x must be a jax.Array \(or a numpy array\), got torch.Tensor; convert it "
                                        r"with jax.dlpack.from_dlpack"):
        epj.dispatch(buffer, torch.zeros(3, case.hidden, dtype=torch.bfloat16), topk, active, case.num_max_tokens,
                     case.num_experts)
    recv, _, handle, active = epj.dispatch(buffer, x, topk, active, case.num_max_tokens, case.num_experts,
                                           use_fp8=False)
    other = spawn(1, lambda g: reference_buffer(g, case))[0]
    with pytest.raises(ValueError, match="handle was made by a dispatch on another Buffer"):
        epj.combine(other, recv, topk, jnp.asarray(case.weights[0]), active, handle)
    with pytest.raises(TypeError, match="handle must be the mooncake_ep.jax.Handle of a dispatch"):
        epj.combine(buffer, recv, topk, jnp.asarray(case.weights[0]), active, "handle")
    with pytest.raises(ValueError, match=r"combine: x must have shape \(2, 4, 256\), got \(2, 3, 256\)"):
        epj.combine(buffer, recv[:, :3], topk, jnp.asarray(case.weights[0]), active, handle)
    with pytest.raises(TypeError, match=r"combine: x must be a jax.Array \(or a numpy array\), got tuple \(an fp8 "
                                        r"dispatch's \(rows, scales\) pair"):
        epj.combine(buffer, (recv, recv), topk, jnp.asarray(case.weights[0]), active, handle)
    # A Python scalar has no producer to convert from (helper-93: the hint had named jax.dlpack).
    with pytest.raises(TypeError, match=r"combine: topk_weights must be a jax.Array \(or a numpy array\), got float; "
                                        r"pass an array of float32, e.g. made with jnp.asarray$"):
        epj.combine(buffer, recv, topk, 0.5, active, handle)
    # Each API's handle given to the other's combine: both classes are called Handle, so the message
    # names the module and the combine that takes it (helper-141).
    host_args = [np.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.actives)]
    host_recv, _, host_handle, _, _ = buffer.dispatch(*host_args, case.num_max_tokens, case.num_experts,
                                                      use_fp8=False)
    with pytest.raises(TypeError, match=r"mooncake_ep.jax.combine: handle must be the mooncake_ep.jax.Handle of a "
                                        r"dispatch, got mooncake_ep.buffer.Handle \(a Buffer.dispatch's: combine it "
                                        r"with Buffer.combine\)$"):
        epj.combine(buffer, recv, topk, jnp.asarray(case.weights[0]), active, host_handle)
    with pytest.raises(TypeError, match=r"^combine: handle must be the Handle returned by Buffer.dispatch, got "
                                        r"mooncake_ep.frameworks.jax_ops.Handle \(a mooncake_ep.jax dispatch's: "
                                        r"combine it with mooncake_ep.jax.combine\)$"):
        buffer.combine(host_recv, host_args[1], case.weights[0], host_args[2], handle=handle)
    # JAX's extended dtypes (a PRNG key array) have no numpy dtype: named by the argument's check.
    keys = jax.random.split(jax.random.key(0), x.shape[0])
    with pytest.raises(TypeError, match=r"^mooncake_ep.jax.dispatch: x must be bfloat16, got key<fry>\n"):
        epj.dispatch(buffer, keys, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)
    # A destroyed Buffer is the call's fault, not x's.
    gone = spawn(1, lambda g: reference_buffer(g, case))[0]
    gone.destroy()
    with pytest.raises(RuntimeError, match=r"^mooncake_ep.jax.dispatch: this Buffer was destroyed"):
        epj.dispatch(gone, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)


def test_unsupported_transformations_name_the_alternative():
    case, buffer, (x, topk, active) = one_rank()
    T, E = case.num_max_tokens, case.num_experts
    with pytest.raises(TypeError, match=r"jax.vmap is not supported .* shard_map"):
        jax.vmap(lambda x: epj.dispatch(buffer, x, topk, active, T, E, use_fp8=False)[0])(jnp.stack([x, x]))
    with pytest.raises(TypeError, match=r"the gradient of an fp8 dispatch is not supported .*\(use_fp8=False\)"):
        jax.grad(lambda x: epj.dispatch(buffer, x, topk, active, T, E)[0][1].sum())(x)
    recv, _, handle, active2 = epj.dispatch(buffer, x, topk, active, T, E, use_fp8=False)
    w = jnp.asarray(case.weights[0])
    with pytest.raises(TypeError, match=r"gradient of combine is a dispatch of num_tokens \* num_topk rows: pass "
                                        r"grad_buffer="):
        jax.grad(lambda w: epj.combine(buffer, recv, topk, w, active2, handle)[0].astype(jnp.float32).sum())(w)
    grad_buffer = spawn(1, lambda g: reference_buffer(g, case, epj.grad_buffer_size_hint(T, case.hidden, 1, E,
                                                                                         case.num_topk)))[0]
    with pytest.raises(TypeError, match=r"renormalize=True is not supported; normalise the weights in the router"):
        jax.grad(lambda w: epj.combine(buffer, recv, topk, w, active2, handle, renormalize=True,
                                       grad_buffer=grad_buffer)[0].astype(jnp.float32).sum())(w)
    with pytest.raises(TypeError, match=r"mooncake_ep.jax.combine: renormalize must be a bool, got numpy.bool"):
        jax.grad(lambda w: epj.combine(buffer, recv, topk, w, active2, handle, renormalize=np.False_,
                                       grad_buffer=grad_buffer)[0].astype(jnp.float32).sum())(w)
    with pytest.raises(ValueError, match=r"grad_buffer must be other Buffers of the same group \(1 ranks\), not the "
                                         r"forward's"):
        epj.combine(buffer, recv, topk, w, active2, handle, grad_buffer=buffer)
    with pytest.raises(ValueError, match=r"grad_buffer has \d+ bytes, the gradient needs \d+ \(grad_buffer_size_hint"):
        epj.combine(buffer, recv, topk, w, active2, handle, grad_buffer=spawn(1, lambda g: reference_buffer(g, case))[0])
    destroyed = spawn(1, lambda g: reference_buffer(g, case, epj.grad_buffer_size_hint(T, case.hidden, 1, E,
                                                                                       case.num_topk)))[0]
    destroyed.destroy()
    with pytest.raises(RuntimeError, match=r"mooncake_ep.jax.combine: grad_buffer: this Buffer was destroyed"):
        epj.combine(buffer, recv, topk, w, active2, handle, grad_buffer=destroyed)
    with pytest.raises(ValueError, match=r"mooncake_ep.jax.combine: grad_num_topk must be <= 16, got 17"):
        epj.combine(buffer, recv, topk, w, active2, handle, grad_buffer=grad_buffer, grad_num_topk=17)
    with pytest.raises(ValueError, match=r"grad_buffer has \d+ bytes, the gradient needs \d+ .*num_topk=16\)\)"):
        epj.combine(buffer, recv, topk, w, active2, handle, grad_buffer=grad_buffer, grad_num_topk=16)
    with pytest.raises(ValueError, match=r"grad_parity must be 0 or 1 \(the workspace half\), got True"):
        epj.combine(buffer, recv, topk, w, active2, handle, grad_buffer=grad_buffer, grad_parity=True)
    with pytest.raises(TypeError, match=r"dispatch_send is not differentiable; for training use "
                                        r"mooncake_ep.jax.dispatch and mooncake_ep.jax.combine"):
        jax.grad(lambda x: epj.dispatch_send(buffer, x, topk, active, T, E).arrays[0].astype(jnp.float32).sum())(x)
    # Without differentiation the same calls are fine.
    combined, _ = epj.combine(buffer, recv, topk, w, active2, handle)
    assert combined.shape == (3, case.hidden)
    # Last: JAX runs the dispatch before it refuses forward mode, which makes handle stale.
    with pytest.raises(TypeError, match="custom_vjp"):  # JAX's own message for forward mode
        jax.jvp(lambda x: epj.dispatch(buffer, x, topk, active, T, E, use_fp8=False)[0], (x,), (x,))


def test_split_form_refuses_arrays_placed_where_its_ops_cannot_run():
    """As the fused ops: a send half's array spread over devices outside shard_map is refused naming it,
    and so are pending ranks' arrays on different devices, which every receive half takes as operands of
    one op (XLA had said only 'args[0] of buffer_callback ... device ids [1]'; helper-88)."""
    devices = cpu_devices(2)
    case = make_case(12, num_ranks=2, num_tokens=[2, 2])
    buffers = spawn(2, lambda g: reference_buffer(g, case))
    put = lambda array, rank: jax.device_put(jnp.asarray(array), devices[rank])  # noqa: E731
    args = lambda rank, on: (put(case.xs[rank], on), put(case.topk_idxs[rank], on),  # noqa: E731
                             put(case.actives[rank], on))
    spread = jax.device_put(jnp.asarray(np.concatenate([case.xs[0], case.xs[0]])),
                            NamedSharding(jax.sharding.Mesh(np.array(devices), ("d",)), P("d")))
    with pytest.raises(ValueError, match=r"dispatch_send: x is spread over 2 devices outside shard_map"):
        epj.dispatch_send(buffers[0], spread, *args(0, 0)[1:], case.num_max_tokens, case.num_experts, use_fp8=False)
    sent = [epj.dispatch_send(buffers[r], *args(r, r), case.num_max_tokens, case.num_experts, use_fp8=False)
            for r in range(2)]
    with pytest.raises(ValueError, match=r"dispatch_recv: the pending ranks' arrays are on different devices "
                                         r"\(rank 0: \['cpu:0'\], rank 1: \['cpu:1'\]\)"):
        epj.dispatch_recv(sent)
    sent = [epj.dispatch_send(buffers[r], *args(r, 0), case.num_max_tokens, case.num_experts, use_fp8=False)
            for r in range(2)]
    assert len(epj.dispatch_recv(sent)) == 2  # one device: accepted


def test_split_form_refusals():
    case = make_case(11, num_ranks=2, num_tokens=[2, 2])
    num_bytes = ep.Buffer.get_ep_buffer_size_hint(2 * case.num_max_tokens, case.hidden, 2, case.num_experts)
    buffers = spawn(2, lambda g: reference_buffer(g, case, num_bytes))
    args = lambda r: (jnp.asarray(case.xs[r]), jnp.asarray(case.topk_idxs[r]),  # noqa: E731
                      jnp.asarray(case.actives[r]))
    sent = [epj.dispatch_send(buffers[r], *args(r), case.num_max_tokens, case.num_experts, use_fp8=False)
            for r in range(2)]
    with pytest.raises(ValueError, match=r"pending holds rank\(s\) \[0\] more than once"):
        epj.dispatch_recv([sent[0], sent[0]])
    with pytest.raises(TypeError, match="pending must be a non-empty list of the dispatch_send results"):
        epj.dispatch_recv(sent[0])
    odd = epj.dispatch_send(buffers[1], *args(1), case.num_max_tokens, case.num_experts, use_fp8=True)
    with pytest.raises(ValueError, match="same T, hidden, num_experts, fp8 flags and parity"):
        epj.dispatch_recv([sent[0], odd])
    with pytest.raises(TypeError, match="buffer must be one rank's mooncake_ep.Buffer"):
        epj.dispatch_send({jax.devices("cpu")[0]: buffers[0]}, *args(0), case.num_max_tokens, case.num_experts)
    # Rank 1 of another group of the same size: on a GPU each kernel would wait for a peer that never sends.
    others = spawn(2, lambda g: reference_buffer(g, case))
    foreign = epj.dispatch_send(others[1], *args(1), case.num_max_tokens, case.num_experts, use_fp8=False)
    with pytest.raises(ValueError, match="different Buffers: rank 1's is not on the Buffer rank 0's is on"):
        epj.dispatch_recv([sent[0], foreign])
    received = epj.dispatch_recv(sent)  # still usable
    assert len(received) == 2
    # Combines of two different steps (here T and 2T): every field of the dispatch's step is compared.
    longer = epj.dispatch_recv([epj.dispatch_send(buffers[r], *args(r), 2 * case.num_max_tokens, case.num_experts,
                                                  use_fp8=False) for r in range(2)])

    def combine_send(rank, results):
        recv, _, handle, active = results[rank]
        return epj.combine_send(buffers[rank], recv, args(rank)[1], jnp.asarray(case.weights[rank]), active, handle)
    with pytest.raises(ValueError, match="every rank's combine must answer the same step"):
        epj.combine_recv([combine_send(0, received), combine_send(1, longer)])
    assert len(epj.combine_recv([combine_send(r, longer) for r in range(2)])) == 2


def test_empty_buffer_mappings_are_refused():
    with pytest.raises(ValueError, match="make_buffers: devices is empty"):
        epj.make_buffers([], 1 << 20)
    with pytest.raises(ValueError, match="destroy_buffers: buffers is empty"):
        epj.destroy_buffers({})


def test_destroy_buffers_takes_the_split_forms_list_and_refuses_part_of_a_group():
    """The split form's Buffers come as a list (LocalGroup.spawn): destroy_buffers failed on it with an
    AttributeError, leaving plain destroy(), which keeps JAX's caches of programs that may replay the
    freed Buffers' launches (helper-143). Part of a group would wait in the collective for the rest."""
    case = _cases.make_case(22, num_ranks=2)
    buffers = ep.LocalGroup(2).spawn(lambda g: ep.Buffer(g, case.size_hint, backend="reference"))
    for part, message in (([buffers[0]], r"every rank's Buffer of one in-process group, each once \(ranks \[0\]"),
                          ([buffers[0], buffers[0]], r"each once \(ranks \[0, 0\] given\)")):
        with pytest.raises(ValueError, match=message):
            epj.destroy_buffers(part)
    with pytest.raises(TypeError, match=r"one rank of an in-process group, .*: pass every rank's Buffer"):
        epj.destroy_buffers(buffers[1])
    with pytest.raises(TypeError, match=r"buffers must hold mooncake_ep Buffers, got str"):
        epj.destroy_buffers([buffers[0], "buffer"])
    with pytest.raises(TypeError, match=r"buffers must be make_buffers' mapping, a sequence of Buffers or one "
                                        r"Buffer, got str"):
        epj.destroy_buffers("buffers")
    assert not any(b._destroyed for b in buffers)  # the refusals destroyed nothing
    epj.destroy_buffers(buffers)
    assert all(b._destroyed for b in buffers)
    # A process's own Buffer of a group of processes (here a group of one) goes alone.
    group = ep.init_group("tcp", rank=0, world_size=1, master_addr="127.0.0.1",
                          master_port=free_port("127.0.0.1"))
    try:
        own = ep.Buffer(group, case.size_hint, backend="reference")
        epj.destroy_buffers(own)
        assert own._destroyed
    finally:
        group.close()


def test_a_grad_buffer_of_another_rank_is_refused():
    """One Buffer per rank (the eager form): each rank's gradient dispatch runs on grad_buffer as
    grad_buffer's rank, so another rank's Buffer of the gradient's group let every collective complete
    with the ranks' gradients swapped (helper-93: rank 1's values in rank 0's gradient). Refused when
    combine is called, on every rank; each rank's own grad Buffer then gives a gradient."""
    T, H, E = 2, 128, 4
    case = make_case(21, num_ranks=2, num_tokens=[2, 2], num_max_tokens=T, hidden=H, num_experts=E)
    cpu_devices(2)
    grad_buffers = [None, None]

    def rank_fn(group):
        rank = group.rank
        buffer = ep.Buffer(group, ep.Buffer.get_ep_buffer_size_hint(T, H, 2, E), backend="reference")
        grad_buffers[rank] = ep.Buffer(group, epj.grad_buffer_size_hint(T, H, 2, E, case.num_topk),
                                       backend="reference")
        group.barrier()

        def loss(w, grad_buffer):
            active = jnp.ones(2, jnp.int32)
            recv, _, handle, active = epj.dispatch(buffer, jnp.asarray(case.xs[rank]), case.topk_idxs[rank], active,
                                                   T, E, use_fp8=False)
            out, _ = epj.combine(buffer, recv, case.topk_idxs[rank], w, active, handle, grad_buffer=grad_buffer)
            return jnp.sum(out.astype(jnp.float32))

        w = jnp.asarray(case.weights[rank])
        with jax.default_device(jax.devices("cpu")[rank]):
            with pytest.raises(ValueError, match=rf"mooncake_ep.jax.combine: grad_buffer is rank {1 - rank} of its "
                                                 rf"group, buffer rank {rank}: pass this rank's Buffer"):
                jax.grad(loss)(w, grad_buffers[1 - rank])
            group.barrier()  # both refused before the dispatch's peers moved on
            return np.asarray(jax.grad(loss)(w, grad_buffers[rank])).shape

    assert spawn(2, rank_fn) == [case.weights[0].shape, case.weights[1].shape]


def test_a_mapping_must_give_each_device_its_own_rank_of_one_buffer():
    """Checked when the op is traced (helper-88): one rank's Buffer on two devices had made each step's calls
    twice on it and failed at run time as a mismatched call; Buffers of two groups waited out the group
    timeout in a collective their peers never joined. The mapping of make_buffers still works."""
    devices = cpu_devices(2)
    case = make_case(13, num_ranks=2, num_tokens=[2, 2])
    buffers, others = (epj.make_buffers(devices, case.size_hint, timeout_s=GROUP_TIMEOUT_S) for _ in range(2))
    x, topk, active = jnp.asarray(case.xs[0]), jnp.asarray(case.topk_idxs[0]), jnp.asarray(case.actives[0])
    for mapping, message in (({devices[0]: buffers[devices[0]], devices[1]: buffers[devices[0]]},
                              r"dispatch: the mapping gives rank 0's Buffer to 2 devices \(cpu:0, cpu:1\); each "
                              r"device must have a rank of its own"),
                             ({devices[0]: buffers[devices[0]], devices[1]: others[devices[1]]},
                              r"dispatch: the Buffers of the mapping must be the ranks of one Buffer \(make_buffers' "
                              r"result\), got Buffers of 2 different ones")):
        with pytest.raises(ValueError, match=message):
            epj.dispatch(mapping, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)
    assert jax_args.as_ranks("test", buffers).first is not None
    epj.destroy_buffers(buffers)
    epj.destroy_buffers(others)


def test_make_buffers_takes_distinct_devices_or_a_mesh_array():
    """A repeated device made a group of two ranks and a mapping of one (rank 0 leaked, and the
    mapping could not be destroyed); a 2-D mesh.devices failed on its rows' missing .platform."""
    devices = cpu_devices(4)
    with pytest.raises(ValueError, match="devices must be distinct, one per rank; cpu:0 appears 2 times"):
        epj.make_buffers([devices[0], devices[0]], 1 << 20)
    with pytest.raises(TypeError, match="devices must be JAX devices, got int"):
        epj.make_buffers([0, 1], 1 << 20)
    # A bare "object is not iterable", or a set's arbitrary order as the ranks' (helper-148)
    for not_in_order in (devices[0], None, set(devices)):
        with pytest.raises(TypeError, match=rf"^make_buffers: devices must be JAX devices in rank order \(a sequence, "
                                            rf"a Mesh or its devices array\), got {type(not_in_order).__name__}"):
            epj.make_buffers(not_in_order, 1 << 20)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("ep", "dp"))
    for given in (mesh.devices, mesh):  # the docstring's mesh.devices, and the Mesh itself
        buffers = epj.make_buffers(given, 1 << 20)
        assert [(device, buffer.rank) for device, buffer in buffers.items()] == list(zip(mesh.devices.flat, range(4)))
        epj.destroy_buffers(buffers)


def test_programs_traced_before_destroy_buffers_are_traced_again_and_refused():
    """A jitted program recorded into a command buffer would replay its launches on freed workspaces
    without calling back: destroy_buffers clears JAX's caches, so the program is traced again, and
    its ops refuse the destroyed Buffers by name."""
    devices = cpu_devices(1)
    case = make_case(8, num_ranks=1, num_experts=2, num_topk=1, num_tokens=[2])
    buffers = epj.make_buffers(devices, case.size_hint)
    traces = []

    @jax.jit
    def step(x, topk, active):
        traces.append(1)
        return epj.dispatch(buffers, x, topk, active, case.num_max_tokens, case.num_experts, use_fp8=False)[1]

    args = [jnp.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.actives)]
    step(*args)
    step(*args)
    assert len(traces) == 1
    epj.destroy_buffers(buffers)
    with pytest.raises(RuntimeError, match="mooncake_ep.jax.dispatch: this Buffer was destroyed"):
        step(*args)
    assert len(traces) == 2


def test_grad_buffer_size_hint_is_the_hint_for_t_times_k_tokens():
    assert epj.grad_buffer_size_hint(8, 256, 2, 4, 3) == ep.Buffer.get_ep_buffer_size_hint(24, 256, 2, 4)
    with pytest.raises(ValueError, match=r"grad_buffer_size_hint: num_topk must be >= 1, got 0"):
        epj.grad_buffer_size_hint(8, 256, 2, 4, 0)
    assert epj.grad_buffer_size_hint is ep.Buffer.get_grad_buffer_size_hint  # one rule for both front ends


# --- the GPU launch path of the ops, on a recording backend ----------------------------------------------


class RecordingCuda:
    """What Buffer uses of the CUDA backend, recording launches (as in test_buffer_launch.py)."""

    device_id = 0

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.launches = []
        self.layouts = []

    def agree_on(self, configuration, where="dispatch"):
        self.layouts.append(("agreed", configuration, where))

    def layout_for(self, num_max_tokens, hidden, num_experts):
        from mooncake_ep import layout

        self.layouts.append((num_max_tokens, hidden, num_experts))
        return layout.compute_layout(self.num_ranks, num_experts, num_max_tokens, hidden), 0x1000

    def upload_layouts(self, stream_ptr):
        self.layouts.append(("uploaded", stream_ptr))

    def dispatch_launch(self, parity, layout_ptr, **args):
        def launch(phases, stream_ptr):
            self.launches.append(("dispatch", phases, parity, stream_ptr, args))
        return launch

    def combine_launch(self, parity, layout_ptr, **args):
        def launch(phases, stream_ptr):
            self.launches.append(("combine", phases, parity, stream_ptr, args))
        return launch


class FakeContext:
    """buffer_callback's ExecutionContext: XLA's stream and the execution stage."""

    stream = 0x5EED
    stage = type("Stage", (), {"name": "EXECUTE"})()


class FakeXlaBuffer:
    """A buffer XLA hands a buffer_callback on a GPU (jaxlib's ffi.Buffer), over host memory, and ``ptr``
    for the tests. As jaxlib's, its CUDA array interface has no type string for fp8 and raises."""

    __module__ = "jax.experimental.buffer_callback"  # the module jaxlib's type reports

    def __init__(self, array: np.ndarray, writeable: bool = True, device_id: int = 0):
        self.array = np.ascontiguousarray(array)
        self.ptr, self.shape, self.dtype = self.array.ctypes.data, self.array.shape, self.array.dtype
        self.writeable, self.device_id = writeable, device_id

    def __dlpack_device__(self) -> tuple[int, int]:
        return (jax_args.DLPACK_CUDA, self.device_id)

    @property
    def __cuda_array_interface__(self) -> dict:  # as jaxlib's: no strides (dense), no stream, version 2
        if self.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            raise RuntimeError("UNIMPLEMENTED: Unimplemented primitive type F8E4M3FN")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, not self.writeable), "version": 2}

    def __dlpack__(self, **kwargs):  # as jaxlib's: versioned, READ_ONLY unless writeable, no strides
        assert self.writeable, "XLA's fp8 buffers are outputs; DeviceMemoryArray has no read-only flag"
        return DeviceMemoryArray(self.ptr, self.shape, self.dtype.name, "cuda", self.device_id,
                                 owner=self.array).__dlpack__(**kwargs)


def device_array(array: np.ndarray) -> FakeXlaBuffer:
    """Host memory that presents itself as cuda:0 memory, as XLA's GPU buffers do."""
    return FakeXlaBuffer(array)


def test_the_callbacks_read_xla_gpu_buffers_from_their_attributes():
    """XLA's GPU buffers are read without DLPack (its capsules cost ~10 us a buffer): address, shape,
    dtype (bf16 as ml_dtypes gives it), row-major strides, device, and read-only inputs. fp8 ones
    through DLPack, as jaxlib's CUDA array interface raises for them (helper-103)."""
    rows = np.arange(2 * 3 * 256, dtype=np.float32).reshape(2, 3, 256)
    for array, dtype, writeables in [(rows.astype(BF16), "bfloat16", (False, True)),
                                     (rows.astype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn", (True,)),
                                     (np.arange(6, dtype=np.int32), "int32", (False, True))]:
        for writeable in writeables:
            buffer = FakeXlaBuffer(array, writeable=writeable, device_id=3)
            view, device = jax_ops._read("test", "x", buffer)
            assert device == (jax_args.DLPACK_CUDA, 3)
            assert (view.ptr, view.shape, view.dtype, view.device_type, view.device_id, view.readonly, view.framework) \
                == (buffer.ptr, array.shape, dtype, "cuda", 3, not writeable, "jax")
            assert view.strides == tuple(s // array.itemsize for s in array.strides)
    with pytest.raises(TypeError, match=r"^test: x has a dtype no argument of mooncake_ep takes: numpy dtype complex64"):
        jax_ops._read("test", "x", FakeXlaBuffer(np.zeros(4, np.complex64)))


def cuda_rank(ranks_on_device: int = 1):
    case = make_case(12, num_ranks=1, num_experts=2, num_tokens=[3])
    buffer = spawn(1, lambda g: reference_buffer(g, case))[0]
    cuda = RecordingCuda(1)
    buffer._cuda, buffer.backend, buffer._in_process_ranks_on_device = cuda, "cuda", ranks_on_device
    return case, buffer, cuda


def test_the_callback_launches_on_xlas_stream_with_the_static_parity():
    case, buffer, cuda = cuda_rank()
    T, E, H = case.num_max_tokens, case.num_experts, case.hidden
    x, topk, active = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (case.xs[0], case.topk_idxs[0], case.actives[0]))
    config, specs = jax_ops.dispatch_config("test", jax_args.Ranks(buffer), x, topk, active, T, E, timeout_us=250,
                                            use_fp8=True, round_scale=False, use_ue8m0=False, parity=1,
                                            command_buffer_compatible=True)
    assert cuda.layouts == [("agreed", (T, H, E, True, False, False), "test"), (T, H, E), ("uploaded", None)], \
        "the configuration is agreed and the layout uploaded at trace time (synchronously), before any recording"
    assert [(name, shape) for name, shape, _ in specs] == [("recv_x", (2, T, H)), ("recv_scales", (2, T, H // 128)),
                                                          ("recv_count", (2,))]
    outs = [device_array(np.zeros(shape, dtype)) for _, shape, dtype in
            [(n, s, np.dtype(ml_dtypes.float8_e4m3fn) if d == "float8_e4m3fn" else d) for n, s, d in specs]]
    outs.append(device_array(case.actives[0].copy()))
    ins = [device_array(a) for a in (case.xs[0], case.topk_idxs[0], case.actives[0])]
    callback = jax_ops._DispatchCallback("test", config, jax_ops.SEND | jax_ops.RECV)
    num_dispatches = buffer._num_dispatches
    for _ in range(2):  # a re-recording launches exactly the same, whatever the host counter says
        callback(FakeContext(), outs, *ins)
    assert buffer._num_dispatches == num_dispatches, "the host counter is not used"
    # Both halves in one launch (as Buffer's synchronous dispatch), on XLA's stream, with the static parity.
    assert [(k, phases, parity, stream) for k, phases, parity, stream, _ in cuda.launches] == \
        [("dispatch", jax_ops.SEND | jax_ops.RECV, 1, 0x5EED)] * 2
    args = cuda.launches[0][4]
    assert args["x_ptr"] == ins[0].ptr and args["topk_ptr"] == ins[1].ptr
    assert args["active_ptr"] == outs[-1].ptr, "the kernels update the aliased output mask, not the input"
    assert (args["recv_x_ptr"], args["recv_scales_ptr"], args["recv_count_ptr"]) == tuple(o.ptr for o in outs[:3])
    assert args["timeout_ns"] == 250_000 and args["topk_is_int64"] is False
    # The GPU handle: recv_count, and the ids as given (combine's gradient routes by them).
    handle = jax_ops._dispatch_results(config, specs, outs, ins[1])[2]
    assert handle.arrays == (outs[2], ins[1]) and handle.dispatched_topk_idx is ins[1]
    # A stage other than EXECUTE (XLA preparing the handler) launches nothing.
    preparing = type("Ctx", (), {"stream": 1, "stage": type("S", (), {"name": "PREPARE"})()})()
    callback(preparing, outs, *ins)
    assert len(cuda.launches) == 2
    # Equal configurations give equal callbacks: an eager call finds JAX's compiled op again.
    assert callback == jax_ops._DispatchCallback("test", config, jax_ops.SEND | jax_ops.RECV)
    assert hash(callback) == hash(jax_ops._DispatchCallback("test", config, jax_ops.SEND | jax_ops.RECV))


def split_dispatch(use_fp8: bool):
    """One split dispatch of rank 0 of 4 on one GPU, through the stand-in backend: its send half, then
    its receive half into zeroed results. Returns the case, the buffer, the backend's launches, the
    dispatch's configuration, the input shapes (x, topk_idx, active_ranks) and arrays, the send half's
    active_ranks and the results."""
    from mooncake_ep.frameworks import jax_split

    case, buffer, cuda = cuda_rank(ranks_on_device=4)
    arrays = (case.xs[0], case.topk_idxs[0], case.actives[0])
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    config, specs = jax_ops.dispatch_config("test", jax_args.Ranks(buffer), *shapes, case.num_max_tokens,
                                            case.num_experts, timeout_us=-1, use_fp8=use_fp8, round_scale=False,
                                            use_ue8m0=False, parity=0, command_buffer_compatible=True)
    ins = [device_array(a) for a in arrays]
    sent = device_array(case.actives[0].copy())
    jax_ops._DispatchCallback("test", config, jax_ops.SEND)(FakeContext(), [sent], *ins)
    dtypes = {"bfloat16": BF16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
    outs = [device_array(np.zeros(shape, dtypes.get(d, d))) for _, shape, d in specs]
    outs.append(device_array(case.actives[0].copy()))
    jax_split._DispatchRecvCallback("test", config, 0, (0,))(FakeContext(), outs, ins[0], ins[1], sent)
    return case, buffer, cuda, config, shapes, ins, sent, outs


def test_the_split_callbacks_launch_one_half_each():
    from mooncake_ep.frameworks import jax_split

    case, buffer, cuda, config, (_, topk, active), ins, sent, outs = split_dispatch(use_fp8=False)
    T, E = case.num_max_tokens, case.num_experts
    assert [(k, phases) for k, phases, _, _, _ in cuda.launches] == [("dispatch", 1), ("dispatch", 2)]
    assert cuda.launches[0][4]["active_ptr"] == sent.ptr and cuda.launches[1][4]["active_ptr"] == outs[-1].ptr
    # The split combine never lets peers read the expert outputs in place: that makes a receive half
    # wait until every peer has read, and the peers' receive halves queue behind it on this stream.
    handle = jax_ops.Handle(config, (outs[-2],))
    y = np.ones((E, T, case.hidden), BF16)
    weights = case.weights[0]
    combine_config, _ = jax_ops.combine_config(
        "test", jax_args.Ranks(buffer), jax.ShapeDtypeStruct(y.shape, y.dtype), topk,
        jax.ShapeDtypeStruct(weights.shape, weights.dtype), active, handle,
        timeout_us=-1, renormalize=False, command_buffer_compatible=True)
    combine_ins = [device_array(a) for a in (y, case.topk_idxs[0], weights, case.actives[0])] + [outs[-2]]
    combined = device_array(np.zeros((case.xs[0].shape[0], case.hidden), BF16))
    jax_ops._CombineCallback("test", combine_config, jax_ops.SEND, direct_reads=False)(
        FakeContext(), [sent], *combine_ins)
    jax_split._CombineRecvCallback("test", combine_config, 0, (len(combine_ins),), (0,))(
        FakeContext(), [combined, sent], *combine_ins)
    jax_ops._CombineCallback("test", combine_config, jax_ops.SEND | jax_ops.RECV)(
        FakeContext(), [combined, sent], *combine_ins)
    combines = [(phases, args["direct_reads"]) for k, phases, _, _, args in cuda.launches if k == "combine"]
    assert combines == [(1, False), (2, False), (3, True)]
    # The fused op refuses several ranks on one GPU (one XLA stream) and names the split form.
    # (Under jit: traced arrays have no device yet, so this is the first refusal.)
    with pytest.raises(ValueError, match=r"4 ranks of this Buffer's group share cuda:0.*use the split form"):
        jax.jit(lambda x, t, a: epj.dispatch(buffer, x, t, a, T, E))(
            jnp.asarray(case.xs[0]), jnp.asarray(case.topk_idxs[0]), jnp.asarray(case.actives[0]))


def test_the_split_fp8_dispatch_launches_its_halves_with_the_scales_layout_of_the_receive_half():
    """The send half writes no results (null pointers, no scales layout: it once failed reading one);
    the receive half writes XLA's row-major scales."""
    case, _, cuda, _, _, _, _, outs = split_dispatch(use_fp8=True)
    launched = [(phases, args["recv_scales_ptr"], args["scale_row_stride"], args["scale_column_stride"])
                for _, phases, _, _, args in cuda.launches]
    assert launched == [(1, 0, 0, 0), (2, outs[1].ptr, case.hidden // 128, 1)]


def test_eager_calls_check_the_arrays_devices_at_once():
    case, buffer, _ = cuda_rank()
    T, E = case.num_max_tokens, case.num_experts
    args = [jnp.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.actives)]
    with pytest.raises(TypeError, match=r"mooncake_ep.jax.dispatch: x: the computation runs on the CPU, this Buffer "
                                        r"runs its kernels on cuda:0; build a Buffer with backend='reference'"):
        epj.dispatch(buffer, *args, T, E)
    devices = cpu_devices(3)
    mapping = {devices[0]: spawn(1, lambda g: reference_buffer(g, case))[0]}
    on_two = [jax.device_put(a, devices[2]) for a in args]
    with pytest.raises(ValueError, match=r"mooncake_ep.jax.dispatch: x: no Buffer for cpu:2; the mapping has cpu:0"):
        epj.dispatch(mapping, *on_two, T, E)
    # Arrays of one call placed on different devices, named (XLA's message names "args[1] of
    # buffer_callback").
    one = mapping[devices[0]]
    placed = [jax.device_put(a, devices[0]) for a in args]
    with pytest.raises(ValueError, match=r"dispatch: topk_idx is on cpu:2, x on cpu:0; put every array of the call"):
        epj.dispatch(one, placed[0], on_two[1], placed[2], T, E, use_fp8=False)
    recv, _, handle, active = epj.dispatch(one, *placed, T, E, use_fp8=False)
    weights = jax.device_put(jnp.asarray(case.weights[0]), devices[0])
    with pytest.raises(ValueError, match=r"combine: topk_weights is on cpu:2, x on cpu:0"):
        epj.combine(one, recv, placed[1], jax.device_put(weights, devices[2]), active, handle)
    moved = [jax.device_put(a, devices[2]) for a in (recv, placed[1], weights, active)]
    with pytest.raises(ValueError, match=r"combine: handle is on cpu:0, x on cpu:2"):
        epj.combine(one, *moved, handle)
    epj.combine(one, recv, placed[1], weights, active, handle)  # still usable
    # An array not committed to a device (numpy, converted) goes where the others are, as JAX moves it.
    epj.dispatch(one, placed[0], case.topk_idxs[0], placed[2], T, E, use_fp8=False)


def test_eager_calls_run_one_compiled_program_per_configuration(monkeypatch):
    """Eagerly each op runs as jax.jit of itself: traced once per configuration and shapes, where JAX had
    traced the custom_vjp and run its primitives one by one every call (~1.2 ms on a GPU's host). Every
    call's results are still the reference's for its own inputs; a Buffer destroyed once its programs
    exist is refused by every form (a command buffer would replay the launches without calling back)."""
    traced = []
    for name in ("dispatch_config", "combine_config"):
        real = getattr(jax_ops, name)
        monkeypatch.setattr(jax_ops, name, functools.partial(lambda real, name, *a, **k: traced.append(name)
                                                             or real(*a, **k), real, name))
    flags = FLAGS["fp8"]
    cases = [make_case(seed, num_ranks=1, num_experts=2, num_tokens=[3]) for seed in (20, 21, 22)]
    T, E = cases[0].num_max_tokens, cases[0].num_experts
    buffer = spawn(1, lambda g: reference_buffer(g, cases[0]))[0]
    for case in cases:
        x, topk, weights, active = (jnp.asarray(a[0]) for a in (case.xs, case.topk_idxs, case.weights, case.actives))
        recv, count, handle, active = epj.dispatch(buffer, x, topk, active, T, E, **flags)
        combined, active = epj.combine(buffer, expert_fn(0, recv, flags), topk, weights, active, handle)
        dispatched, want = expected(case, flags)
        check_rank(0, dispatched[0], recv, count, flags)
        np.testing.assert_array_equal(bits(combined), bits(want[0][0]))
        np.testing.assert_array_equal(active, want[0][1])
    assert traced == ["dispatch_config", "combine_config"]
    sent = [epj.dispatch_send(buffer, x, topk, active, T, E, **flags) for _ in range(2)]
    epj.dispatch_recv(sent[:1])
    # Options equal to a compiled call's but of another type are still refused (helper-102: they had found
    # its program unchecked).
    y = expert_fn(0, recv, flags)
    for call, name, value in [
            (lambda **o: epj.dispatch(buffer, x, topk, active, T, E, **flags, **o), "command_buffer_compatible", 1),
            (lambda **o: epj.dispatch(buffer, x, topk, active, T, E, **flags, **o), "timeout_us", -1.0),
            (lambda **o: epj.combine(buffer, y, topk, weights, active, handle, **o), "timeout_us", -1.0),
            (lambda **o: epj.combine(buffer, y, topk, weights, active, handle, **o), "command_buffer_compatible",
             np.True_),
            (lambda **o: epj.dispatch_send(buffer, x, topk, active, T, E, **(flags | o)), "use_fp8", 1),
            (lambda **o: epj.dispatch_send(buffer, x, topk, active, T, E, **flags, **o), "parity", False)]:
        with pytest.raises((TypeError, ValueError), match=f"{name} must be"):
            call(**{name: value})
    buffer.destroy()
    with pytest.raises(RuntimeError, match=r"^mooncake_ep.jax.dispatch: this Buffer was destroyed"):
        epj.dispatch(buffer, x, topk, active, T, E, **flags)
    with pytest.raises(RuntimeError, match=r"^mooncake_ep.jax.combine: this Buffer was destroyed"):
        epj.combine(buffer, expert_fn(0, recv, flags), topk, weights, active, handle)
    with pytest.raises(RuntimeError, match=r"^mooncake_ep.jax.dispatch_send: this Buffer was destroyed"):
        epj.dispatch_send(buffer, x, topk, active, T, E, **flags)
    with pytest.raises(RuntimeError, match=r"^mooncake_ep.jax.dispatch_recv: this Buffer was destroyed"):
        epj.dispatch_recv(sent[1:])


def test_a_cuda_buffer_refuses_cpu_buffers_and_the_wrong_gpu():
    case, buffer, _ = cuda_rank()
    ranks = jax_args.Ranks(buffer)
    with pytest.raises(TypeError, match="the computation runs on the CPU, this Buffer runs its kernels on cuda:0"):
        ranks.select("test", (1, 0))
    with pytest.raises(TypeError, match="the arrays are on cuda:1, this Buffer's rank uses cuda:0"):
        ranks.select("test", (2, 1))
    assert ranks.select("test", (2, 0)) is buffer


def test_buffer_mappings_compare_by_content_and_name_their_devices():
    case = make_case(13, num_ranks=2)
    devices = cpu_devices(2)
    buffers = spawn(2, lambda g: reference_buffer(g, case))
    forward = jax_args.as_ranks("t", {devices[0]: buffers[0], devices[1]: buffers[1]})
    backward = jax_args.as_ranks("t", {devices[1]: buffers[1], devices[0]: buffers[0]})
    assert forward == backward and hash(forward) == hash(backward)  # a handle is valid with either dict
    assert forward.select("t", (1, 1)) is buffers[1]
    with pytest.raises(ValueError, match="t: no Buffer for cpu:5; the mapping has cpu:0, cpu:1"):
        forward.select("t", (1, 5))
    with pytest.raises(TypeError, match="arrays are on cuda:0, this Buffer runs on the numpy reference backend"):
        jax_args.Ranks(buffers[0]).select("t", (2, 0))
    with pytest.raises(TypeError, match=r"buffer mapping must be \{jax.Device: Buffer\}"):
        jax_args.as_ranks("t", {"cpu:0": buffers[0]})
    with pytest.raises(ValueError, match="buffer mapping is empty"):
        jax_args.as_ranks("t", {})
