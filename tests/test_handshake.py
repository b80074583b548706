"""The checks every rank of a Buffer makes about the others (mooncake_ep/_handshake.py).

CPU only: the rules on lists of configurations, then through Buffer construction and
update_ep_member with LocalGroup ranks on the reference backend, where every rank must raise the
same error and the group must stay usable for a correct Buffer afterwards. Processes are in
test_buffer_multiprocess.py.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import _handshake, reference
from mooncake_ep._handshake import CONSTRUCT, UPDATE, RankConfig

T, H, R, E = 4, 128, 3, 6
SIZE = ep.Buffer.get_ep_buffer_size_hint(T, H, R, E)


def config(**fields) -> RankConfig:
    return dataclasses.replace(RankConfig("0.1.0", CONSTRUCT, "reference", SIZE), **fields)


def gpu(device: str, num_sms: int = 0, num_device_sms: int = 132, **fields) -> RankConfig:
    return config(backend="cuda", device=device, device_name=f"cuda:0 (GPU {device}) on h", num_sms=num_sms,
                  num_device_sms=num_device_sms, **fields)


def on_every_rank(num_ranks: int, fn) -> list:
    """fn(group) on LocalGroup threads; each rank's result or exception (so all ranks are seen)."""
    out = [None] * num_ranks

    def rank_fn(group):
        try:
            out[group.rank] = fn(group)
        except (ValueError, RuntimeError) as exc:
            out[group.rank] = exc

    ep.LocalGroup(num_ranks, timeout_s=30.0).spawn(rank_fn)
    return out


class ProcessRank:
    """A LocalGroup rank posing as a process's (a torch or MPI group's, without membership epochs), on
    the GPU named by ``device``; a new one is a new process's group (a replacement's)."""

    is_in_process = False

    def __init__(self, group, device=None):
        self._group, self.rank, self.world_size, self.device = group, group.rank, group.world_size, device

    def allgather_bytes(self, data):
        return self._group.allgather_bytes(data)

    def barrier(self):
        self._group.barrier()


# ----------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("configs,error,pattern", [
    ([config(), config(version="0.2.0"), config()], ValueError,
     r"Buffer: ranks disagree on mooncake_ep version \(ranks \[0, 2\]: '0\.1\.0', rank 1: '0\.2\.0'\); "
     r"install the same mooncake_ep on every rank"),
    ([config(), config(backend="cuda"), config()], ValueError,
     r"ranks disagree on backend \(ranks \[0, 2\]: 'reference', rank 1: 'cuda'\); pass the same backend= .*'auto'"),
    ([config(), config(), config(num_ep_buffer_bytes=SIZE + 1)], ValueError,
     rf"ranks disagree on num_ep_buffer_bytes \(ranks \[0, 1\]: {SIZE}, rank 2: {SIZE + 1}\); size every rank's "
     rf"buffer with Buffer.get_ep_buffer_size_hint"),
    ([config(phase=UPDATE, num_dispatches=4, backend="cuda"), config(phase=UPDATE, num_dispatches=5, backend="cuda"),
      config(backend="cuda")], ValueError,
     r"ranks made different numbers of dispatches \(rank 0: 4, rank 1: 5\); every rank must call dispatch"),
    ([config(phase=UPDATE), config(phase=UPDATE, num_pending_hooks=1), config()], RuntimeError,
     r"ranks \[1\] have receive hooks pending; call them \(on every rank\) before update_ep_member"),
    # A live rank's new Buffer at the others' update: its process holds the Buffer they update (refused
    # before its size, which may differ too); a replacement's holds another Buffer, or none.
    ([config(phase=UPDATE, token="a"), config(held_tokens=("b",)),
      config(num_ep_buffer_bytes=SIZE + 1, held_tokens=("a", "b"))], ValueError,
     r"^Buffer: ranks \[2\] are building a new Buffer while ranks \[0\] update theirs \(update_ep_member\), a "
     r"Buffer that the processes of ranks \[2\] hold themselves \(only a process that took over a dead rank, "
     r"init_group\(rejoin=True\), builds its Buffers there\): a rank whose process lives calls "
     r"Buffer\.update_ep_member\(\) on each of its Buffers"),
])
def test_mismatches_are_named(configs, error, pattern):
    with pytest.raises(error, match=pattern):
        _handshake.check(configs, "Buffer")


def test_reference_ranks_with_different_counts_adopt_the_most():
    """On the CPU a collective that timed out on some ranks counted its dispatch only on the others;
    no device counter must agree, so update_ep_member repairs the group with the largest count."""
    configs = [config(phase=UPDATE, num_dispatches=4), config(phase=UPDATE, num_dispatches=5)]
    _handshake.check(configs, "update_ep_member")
    assert _handshake.running_dispatches(configs) == 5


def test_matching_configs_pass_and_a_replacement_continues_the_count():
    survivors = [config(phase=UPDATE, num_dispatches=7), config(phase=UPDATE, num_dispatches=7)]
    configs = survivors[:1] + [config()] + survivors[1:]
    _handshake.check(configs, "update_ep_member")
    assert _handshake.running_dispatches(configs) == 7
    assert _handshake.replaced_ranks(configs) == [1]
    fresh = [config(), config()]
    assert _handshake.running_dispatches(fresh) == 0 and _handshake.replaced_ranks(fresh) == []


def test_num_sms_shares_each_gpu_among_its_ranks():
    configs = [gpu("a"), gpu("a"), gpu("b"), gpu("a"), gpu("b", num_sms=60)]
    assert [_handshake.num_sms_for(configs, r, "Buffer") for r in range(5)] == [44, 44, 66, 44, 60]


def test_an_oversubscribed_gpu_is_refused_naming_its_ranks():
    configs = [gpu("a", num_sms=100), gpu("a"), gpu("b")]
    with pytest.raises(ValueError, match=re.escape(
            "Buffer: the 2 ranks on cuda:0 (GPU a) on h need num_sms rank 0: 100, rank 1: 66, 166 SMs in all, the "
            "device has 132: every rank's kernel must be resident at once, so use num_sms <= 66")):
        _handshake.num_sms_for(configs, 2, "Buffer")  # rank 2 (on GPU b) raises too: every rank checks all


def test_a_replacement_gets_what_the_running_ranks_leave_on_its_gpu():
    """At an update the survivors send the blocks they run with; a replacement that asks for none shares
    what they leave, not an even share of the device (which ignored them: 66 + 66 + 44 on 132 SMs)."""
    configs = [gpu("a", 60, phase=UPDATE), gpu("a"), gpu("b", 66, phase=UPDATE), gpu("b", 66, phase=UPDATE),
               gpu("c", 100, phase=UPDATE), gpu("c"), gpu("c")]
    assert [_handshake.num_sms_for(configs, r, "update_ep_member") for r in range(7)] == [60, 72, 66, 66, 100, 16, 16]


def test_a_replacement_that_does_not_fit_beside_the_running_ranks_is_refused_naming_them():
    configs = [gpu("a", 66, phase=UPDATE), gpu("a", 66, phase=UPDATE), gpu("b", 66, phase=UPDATE), gpu("a")]
    with pytest.raises(ValueError, match=re.escape(
            "update_ep_member: the 3 ranks on cuda:0 (GPU a) on h need num_sms ranks [0, 1]: 66, rank 3: 1, 133 SMs "
            "in all, the device has 132: every rank's kernel must be resident at once, so ranks [0, 1] run with 132 "
            "of them: place ranks [3] on another GPU")):
        _handshake.num_sms_for(configs, 2, "update_ep_member")
    configs = [gpu("a", 60, phase=UPDATE), gpu("a", 80)]
    with pytest.raises(ValueError, match=re.escape(
            "so ranks [0] run with 60 of them: place ranks [1] on another GPU, or give them num_sms <= 72 each")):
        _handshake.num_sms_for(configs, 0, "update_ep_member")


def test_update_checks_the_sms_on_every_rank_before_any_connects(monkeypatch):
    """Only the replacement checked, in Buffer(), and raised alone: the survivors waited in the connect's
    collective for the group's timeout, and named no cause (helper-152)."""
    from mooncake_ep import _cuda_backend

    connects = []

    class Backend:  # CudaBackend's collectives, without a GPU
        def __init__(self, group, num_bytes, device_id, num_sms, cache, all_on_one_device=False):
            self.group, self.num_sms, self.comm_stream = group, num_sms, None
            self.connect()

        def connect(self, replaced_ranks=()):
            connects.append(self.group.rank)
            self.group.allgather_bytes(b"agreement")
            return list(replaced_ranks)

        def destroy(self):
            pass

    monkeypatch.setattr(_cuda_backend, "CudaBackend", Backend)
    monkeypatch.setattr(_cuda_backend, "device_identity", lambda device_id: (f"h/{device_id}", f"cuda:{device_id}"))
    monkeypatch.setattr(_cuda_backend, "device_sm_count", lambda device_id: 132)

    def rank_fn(group):
        group = ProcessRank(group, device=[0, 0, 1][group.rank])
        buffer = ep.Buffer(group, SIZE, backend="cuda")
        if group.rank == 2:  # its process dies; the replacement starts on the survivors' GPU
            ep.Buffer(ProcessRank(group._group, device=0), SIZE, backend="cuda")
        else:
            buffer.update_ep_member()

    out = on_every_rank(3, rank_fn)
    for rank, error in enumerate(out):
        assert isinstance(error, ValueError), out
        assert str(error).startswith(("update_ep_member" if rank < 2 else "Buffer") + ": the 3 ranks on cuda:0 need "
                                     "num_sms ranks [0, 1]: 66, rank 2: 1"), error
    assert sorted(connects) == [0, 1, 2]  # the construction's only


def test_config_round_trips():
    record = gpu("boot/0000:19:00.0", num_sms=8, phase=UPDATE, num_dispatches=3)
    assert RankConfig.unpack(record.pack()) == record


def test_same_configuration_check_raises_on_every_rank_naming_the_fields_that_differ():
    flags = (True, True, False)
    configurations = [(T, H, E, *flags), (T, H, E, *flags), (T, 2 * H, E, True, False, False)]
    out = on_every_rank(3, lambda g: _handshake.check_same_configuration(g, configurations[g.rank]))
    for error in out:
        assert isinstance(error, _handshake.RankMismatchError), out
        assert str(error) == (f"dispatch: ranks disagree on (hidden, round_scale) (ranks [0, 1]: ({H}, True), rank 2: "
                              f"({2 * H}, False)); every rank must dispatch the same T, hidden, num_experts and fp8 "
                              f"flags, or the kernels would read peers' workspaces at the wrong offsets, or their "
                              f"staged rows in the wrong form")
    assert on_every_rank(3, lambda g: _handshake.check_same_configuration(g, (T, H, E, *flags))) == [None] * 3


def test_a_rank_in_another_call_than_a_configuration_check_is_named():
    """Rank 1 builds a second Buffer (its RankConfig) while rank 0 checks a dispatch's configuration:
    rank 0 read the other call's message as a configuration, a bare struct.error that named no rank."""
    calls = [lambda g: _handshake.check_same_configuration(g, (T, H, E, True, False, False)),
             lambda g: _handshake.exchange(g, config(), "Buffer")]
    out = on_every_rank(2, lambda g: calls[g.rank](g))
    assert isinstance(out[0], _handshake.RankMismatchError) and str(out[0]).startswith(
        "dispatch: the ranks are not in the same call: ranks [1] are not checking a dispatch's configuration"), out
    assert isinstance(out[1], _handshake.RankMismatchError) and "rank 0 is not building a Buffer" in str(out[1]), out


def test_a_rank_of_another_version_with_other_fields_is_named_by_its_version():
    """A mooncake_ep whose RankConfig has a field more failed to unpack and was reported as a rank in
    another call (a dispatch or combine?); the version check that names both never ran."""
    theirs = dict(json.loads(config().pack()), version="0.3.0", num_nvlink_peers=8)
    blobs = [config().pack(), json.dumps(theirs).encode()]
    out = on_every_rank(2, lambda g: _handshake.exchange(_Sends(g, blobs[g.rank]), config(), "Buffer"))
    for error in out:
        assert isinstance(error, _handshake.RankMismatchError), out
    assert str(out[0]) == ("Buffer: ranks disagree on mooncake_ep version (rank 1: '0.3.0', this rank: '0.1.0'); "
                           "install the same mooncake_ep on every rank")


class _Sends:
    """A group that sends ``blob`` in its allgather, whatever its caller packed (another version's rank)."""

    def __init__(self, group, blob: bytes):
        self._group, self._blob = group, blob
        self.rank, self.world_size = group.rank, group.world_size

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        return self._group.allgather_bytes(self._blob)


# ----------------------------------------------------------------------------- through Buffer


def step(buffer: ep.Buffer, rank: int, seed: int) -> np.ndarray:
    """One bf16 dispatch and identity-expert combine; returns combined_x."""
    rng = np.random.default_rng([seed, rank])
    x = rng.standard_normal((T, H)).astype(reference.bfloat16)
    topk = np.stack([rng.permutation(E)[:2] for _ in range(T)]).astype(np.int64)
    weights = np.full((T, 2), 0.5, np.float32)
    active = np.ones(R, np.int32)
    recv_x, _, handle, _, _ = buffer.dispatch(x, topk, active, T, E, use_fp8=False)
    combined, _, _ = buffer.combine(recv_x, topk, weights, active, -1, handle)
    np.testing.assert_array_equal(combined.astype(np.float32), x.astype(np.float32))  # 0.5 x + 0.5 x
    return combined


def test_mismatched_buffer_size_raises_on_every_rank_and_the_group_stays_usable():
    def rank_fn(group):
        wrong = SIZE + 128 * (group.rank == 1)
        with pytest.raises(ValueError, match=rf"Buffer: ranks disagree on num_ep_buffer_bytes \(ranks \[0, 2\]: "
                                             rf"{SIZE}, rank 1: {SIZE + 128}\)"):
            ep.Buffer(group, wrong, backend="reference")
        buffer = ep.Buffer(group, SIZE, backend="reference")
        step(buffer, group.rank, 0)
        buffer.destroy()
        return "ok"

    assert ep.LocalGroup(R, timeout_s=30.0).spawn(rank_fn) == ["ok"] * R


@pytest.mark.parametrize("builder", ["live", "new process"])
def test_only_a_process_that_holds_none_of_the_updated_buffers_builds_one_in_the_others_update(builder):
    """A live rank's new Buffer meeting the others' update had passed for a replacement: the others took
    its new workspace in, named the rank replaced, and gave it their Buffer's name and count (review).
    Its process holds the Buffer they update: refused on every rank, nothing changed (every rank's
    update then replaces nobody). A new process's group (a replacement's) holds none: it joins,
    continuing the count."""
    def rank_fn(group):
        group = ProcessRank(group)
        buffer = ep.Buffer(group, SIZE, backend="reference")
        step(buffer, group.rank, 0)
        refused = replaced = None
        try:
            if group.rank == 2:
                buffer = ep.Buffer(group if builder == "live" else ProcessRank(group._group), SIZE,
                                   backend="reference")
            else:
                replaced = buffer.update_ep_member()
        except _handshake.RankMismatchError as error:
            refused = str(error)
            replaced = buffer.update_ep_member()
        return refused, replaced, buffer.num_dispatches, step(buffer, group.rank, 1).shape

    out = ep.LocalGroup(R, timeout_s=30.0).spawn(rank_fn)
    if builder == "new process":
        assert out == [(None, [2], 1, (T, H)), (None, [2], 1, (T, H)), (None, None, 1, (T, H))], out
        return
    for rank, (refused, replaced, num_dispatches, _) in enumerate(out):
        assert refused == (f"{'Buffer' if rank == 2 else 'update_ep_member'}: ranks [2] are building a new Buffer "
                           f"while ranks [0, 1] update theirs (update_ep_member), a Buffer that the processes of "
                           f"ranks [2] hold themselves (only a process that took over a dead rank, "
                           f"init_group(rejoin=True), builds its Buffers there): a rank whose process lives calls "
                           f"Buffer.update_ep_member() on each of its Buffers, in the order every rank does"), out
        assert (replaced, num_dispatches) == ([], 1), out


def test_a_replacement_that_made_a_call_on_its_buffer_is_a_live_rank_at_the_next_update():
    """A replacement's Buffer, built in the others' update, is not held against it if it builds the Buffer
    again (their update of it may have failed on their side); but once the ranks made a call on it, the
    process is a live rank like any other, and a new Buffer it builds at a later update is the mistake
    (it had passed as a replacement for good, review)."""
    def rank_fn(group):
        process = ProcessRank(group)
        buffer = ep.Buffer(process, SIZE, backend="reference")
        if group.rank == 2:  # its process dies; a new one takes the rank over
            process = ProcessRank(group)
            buffer = ep.Buffer(process, SIZE, backend="reference")
        else:
            assert buffer.update_ep_member() == [2]
        step(buffer, group.rank, 0)
        with pytest.raises(_handshake.RankMismatchError, match=r"ranks \[2\] are building a new Buffer"):
            if group.rank == 2:
                ep.Buffer(process, SIZE, backend="reference")
            else:
                buffer.update_ep_member()
        return buffer.update_ep_member(), step(buffer, group.rank, 1).shape

    assert ep.LocalGroup(R, timeout_s=30.0).spawn(rank_fn) == [([], (T, H))] * R


def test_update_ep_member_refuses_pending_hooks_on_every_rank():
    def rank_fn(group):
        buffer = ep.Buffer(group, SIZE, backend="reference")
        x = np.zeros((1, H), reference.bfloat16)
        topk = np.array([[group.rank * 2]], np.int64)
        _, _, _, _, hook = buffer.dispatch(x, topk, np.ones(R, np.int32), T, E, use_fp8=False,
                                           return_recv_hook=group.rank == 0)
        if hook is not None:
            with pytest.raises(RuntimeError, match=r"update_ep_member: ranks \[0\] have receive hooks pending"):
                buffer.update_ep_member()
            hook()
        else:
            with pytest.raises(RuntimeError, match=r"ranks \[0\] have receive hooks pending"):
                buffer.update_ep_member()
        assert buffer.update_ep_member() == []  # nothing pending, nobody replaced
        step(buffer, group.rank, 1)
        return "ok"

    assert ep.LocalGroup(R, timeout_s=30.0).spawn(rank_fn) == ["ok"] * R
