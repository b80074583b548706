"""Tests of the group adapters (torch.distributed, torch stores, mpi4py, jax.distributed) and init_group's choice.

torch runs gloo across real processes on loopback, jax.distributed runs real processes on the CPU, the
mpi4py adapter runs over a fake communicator of threads and over real MPI processes (mpiexec of the
MPICH wheel that the test extra installs next to the interpreter, or one on PATH). CPU only; no
assertion is about elapsed time, the limits only turn a hang into a failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

import _threads

from mooncake_ep import RankMismatchError
from mooncake_ep.cli.launch import free_port
from mooncake_ep.group import (
    Group,
    GroupError,
    JaxGroup,
    LocalGroup,
    MPIGroup,
    TCPGroup,
    TorchGroup,
    TorchStoreGroup,
    init_group,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Safety net for a test process that hangs (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 90.0
# Timeout of the calls that are expected to time out: long enough for a loaded machine, short for the suite.
SHORT_TIMEOUT_S = 1.0
# Timeout of the calls that are expected to succeed.
LONG_TIMEOUT_S = 30.0
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def payload(rank: int, round_idx: int) -> bytes:
    """Distinct per rank and round, of varying length (empty for rank 0 in round 0)."""
    return f"r{rank}i{round_idx};".encode() * ((rank + round_idx) % 4) + bytes([rank, round_idx])[: rank + round_idx]


def run_in_threads(fns: list) -> list:
    return _threads.run_in_threads(fns, PROCESS_LIMIT_S)


def launch(script: str, envs: list[dict[str, str]], argvs: list[list[str]]) -> list[dict]:
    """Run ``script`` once per (environment, argv) pair, one process per rank, without the launch
    variables of this process; return each process's last stdout line, parsed as JSON."""
    procs = []
    for env, argv in zip(envs, argvs, strict=True):
        base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        procs.append(subprocess.Popen([sys.executable, "-c", script, *argv], cwd=REPO_ROOT, text=True,
                                      env={**base, "PYTHONPATH": str(REPO_ROOT), **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    out = []
    try:
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=PROCESS_LIMIT_S)
            assert proc.returncode == 0, f"process {rank} exited {proc.returncode}: {stderr}"
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


# ----------------------------------------------------------------------------- torch.distributed, processes

TORCH_WORKER = textwrap.dedent("""
    import datetime, json, sys
    import torch.distributed as dist
    from mooncake_ep.group import GroupError, init_group

    def payload(rank, i):
        return f"r{rank}i{i};".encode() * ((rank + i) % 4) + bytes([rank, i])[: rank + i]

    store_port, tcp_port = int(sys.argv[1]), int(sys.argv[2])
    out = {}
    # As under torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set and torch's own store
    # serves MASTER_PORT, so init_group() must use the initialised default group, not the environment.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group = init_group(timeout_s=30.0)
    rank, world_size = group.rank, group.world_size
    out["default"] = [type(group).__name__, rank, world_size, group.is_in_process, group.device]
    out["rounds"] = [[v.hex() for v in group.allgather_bytes(payload(rank, i))] for i in range(3)]
    group.barrier()

    # A subgroup of ranks 0 and 2: ranks inside it are renumbered.
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        sub_group = init_group(sub)
        out["sub"] = [sub_group.rank, sub_group.world_size,
                      [v.hex() for v in sub_group.allgather_bytes(bytes([rank]))]]
        sub_group.barrier()

    # A torch store: rank and world size from the environment; a peer that skips a call is named.
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    store_group = init_group(store, timeout_s=30.0)
    out["store"] = [type(store_group).__name__, [v.hex() for v in store_group.allgather_bytes(payload(rank, 1))]]
    store_group.barrier()
    if rank != 2:
        store_group.timeout_s = float(sys.argv[3])
        try:
            store_group.allgather_bytes(b"late")
        except GroupError as exc:
            out["store_timeout"] = str(exc)

    # Explicit TCP store arguments win over the initialised torch group.
    tcp = init_group(rank=rank, world_size=world_size, master_port=tcp_port, timeout_s=30.0)
    out["tcp"] = [type(tcp).__name__, [v.hex() for v in tcp.allgather_bytes(bytes([rank]))]]
    tcp.close()

    # gloo's monitored barrier names the rank that did not come (last: it breaks the group).
    if rank == 2:
        store.wait(["barrier_done"])
    else:
        try:
            group.timeout_s = float("nan")
        except ValueError as exc:
            out["bad_timeout"] = [str(exc), group.timeout_s]
        group.timeout_s = float(sys.argv[3])
        try:
            group.barrier()
        except GroupError as exc:
            out["barrier_timeout"] = str(exc)
        try:
            group.barrier()
        except GroupError as exc:
            out["after_failure"] = str(exc)
        if rank == 0:
            store.set("barrier_done", b"")
    print(json.dumps(out))
""")


def test_torch_gloo_three_processes():
    pytest.importorskip("torch.distributed")
    world_size, master_port = 3, free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(master_port)} for r in range(world_size)]
    argv = [str(free_port()), str(free_port()), str(SHORT_TIMEOUT_S)]
    out = launch(TORCH_WORKER, envs, [argv] * world_size)
    expected_rounds = [[payload(r, i).hex() for r in range(world_size)] for i in range(3)]
    for rank, result in enumerate(out):
        assert result["default"] == ["TorchGroup", rank, world_size, False, None]
        assert result["rounds"] == expected_rounds
        assert result["store"] == ["TorchStoreGroup", [payload(r, 1).hex() for r in range(world_size)]]
        assert result["tcp"] == ["TCPGroup", [bytes([r]).hex() for r in range(world_size)]]
    assert out[0]["sub"] == [0, 2, ["00", "02"]] and out[2]["sub"] == [1, 2, ["00", "02"]]
    assert "sub" not in out[1]
    for rank in (0, 1):
        message = out[rank]["store_timeout"]
        assert message.startswith(f"allgather_bytes #1 timed out after {SHORT_TIMEOUT_S} s waiting for ranks [2] of 3")
        assert "torch TCPStore" in message
        assert out[rank]["barrier_timeout"].startswith(f"barrier #1 on rank {rank}: torch.distributed barrier (gloo)")
        assert "broken by an earlier failure" in out[rank]["after_failure"]
        # A refused timeout leaves the previous one.
        assert out[rank]["bad_timeout"] == ["TorchGroup.timeout_s: timeout_s must be > 0 seconds (math.inf waits "
                                            "forever), got nan", 30.0], out[rank]["bad_timeout"]
    assert "Ranks 2 failed to pass monitoredBarrier" in out[0]["barrier_timeout"]


# Each worker writes its own file: torchrun merges the workers' stdout, and two lines printed at
# once can interleave.
TORCHRUN_WORKER = textwrap.dedent("""
    import json, pathlib, sys
    from mooncake_ep.group import init_group
    group = init_group(timeout_s=30.0)  # torchrun's agent holds MASTER_PORT: its store, not ours
    out = [type(group).__name__, group.rank, group.world_size,
           [v.hex() for v in group.allgather_bytes(bytes([group.rank]) * (group.rank + 1))]]
    group.barrier()
    pathlib.Path(sys.argv[1], f"rank{group.rank}.json").write_text(json.dumps(out))
""")


def test_init_group_under_torchrun_uses_the_agent_store(tmp_path):
    pytest.importorskip("torch.distributed")
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), str(script), str(tmp_path)], cwd=REPO_ROOT,
                          env={**env, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=PROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [["_TorchrunStoreGroup", r, 2, ["00", "0101"]] for r in range(2)], proc.stdout


def test_an_unreachable_torchrun_store_is_named_within_the_timeout(clean_env):
    """Nothing listens at MASTER_PORT under TORCHELASTIC_USE_AGENT_STORE=True: a GroupError naming the
    store and the wait (TCPStore's own connect tried again after its timeout, twice timeout_s, and
    raised pages of C++ frames)."""
    pytest.importorskip("torch.distributed")
    port = free_port()
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        clean_env.setenv(name, value)
    with pytest.raises(GroupError, match=rf"rank 1 cannot reach torchrun's store at 127.0.0.1:{port} "
                                         rf"\(TORCHELASTIC_USE_AGENT_STORE=True\): nothing answered within 2.0 s"):
        init_group(timeout_s=2.0)


def test_torchrun_store_group_spends_one_timeout_on_the_connection_and_the_rendezvous(clean_env, monkeypatch):
    """The wait for torchrun's store listener took 1.5 s of a 2 s timeout (a fake clock): the join, where
    rank 0 never comes, gets the 0.5 s left instead of 2 s more; the collectives after it all of it."""
    dist = pytest.importorskip("torch.distributed")
    from mooncake_ep import _group_adapters, _group_common, _group_join

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # what torchrun's agent serves
    now = [100.0]

    def slow_connect(host, port, timeout_s):
        now[0] += 1.5
        return real_connect(host, port, timeout_s)

    real_connect = _group_adapters._tcp_store.connect
    monkeypatch.setattr(_group_adapters._tcp_store, "connect", slow_connect)
    def sleep(seconds):
        now[0] += seconds

    clock = types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep)
    for module in (_group_adapters, _group_common, _group_join):  # the join reads the clock in all three
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(_group_adapters, "_MIN_TORCH_TIMEOUT_S", 0.1)
    with pytest.raises(GroupError, match=r"^init_group #0 timed out after 2\.0 s waiting for ranks \[0\] of 2 "
                                         r"\(torch TCPStore, keys mooncake_ep/1/\*\)$"):
        _group_adapters.torchrun_store_group(1, 2, "127.0.0.1", port, timeout_s=2.0)
    assert now[0] == 102.0, now  # rank 1 looked for rank 0's attempt for the 0.5 s left, then gave up
    monkeypatch.undo()  # real time, and a fresh agent
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    groups = run_in_threads([lambda r=r: _group_adapters.torchrun_store_group(r, 2, "127.0.0.1", port,
                                                                              timeout_s=LONG_TIMEOUT_S)
                             for r in range(2)])
    assert [g.timeout_s for g in groups] == [LONG_TIMEOUT_S] * 2, groups
    del agent


def test_restarted_torchrun_workers_meet_whatever_their_predecessors_left(clean_env):
    """torchrun's agent store outlives the workers it restarts. Before, each rank counted its groups there,
    and after a restart in which one rank had built fewer than the others (it died before init_group)
    the ranks waited under different keys, at every restart (reproduced with torchrun --max-restarts 1).
    Here the store holds what an attempt left behind: the old count, and a join attempt rank 0 opened
    before its process died, with rank 1's claim and join in it. Ranks 1 and 2 of the restarted workers
    come first and join that attempt, which does not complete without a live rank 0; rank 0 closes it as
    it opens the next, where all three meet, and they build a second group."""
    dist = pytest.importorskip("torch.distributed")
    from mooncake_ep import _group_adapters, _group_common

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    agent.add("mooncake_ep/groups/0", 1)  # protocol 8's count of rank 0's groups: no longer read
    pair = _group_common._INIT.pack(_group_common._PROTOCOL_VERSION, 3)
    agent.add("mooncake_ep/generation", 1)
    agent.set("mooncake_ep/1/init/world_size", pair)
    for rank in (0, 1):
        agent.set(f"mooncake_ep/1/c/0/{rank}", _group_common._slot_value("init_group", pair))
    agent.add("mooncake_ep/1/claim/1", 1)

    def rank_fn(rank):
        first = _group_adapters.torchrun_store_group(rank, 3, "127.0.0.1", port, timeout_s=LONG_TIMEOUT_S)
        second = _group_adapters.torchrun_store_group(rank, 3, "127.0.0.1", port, timeout_s=LONG_TIMEOUT_S)
        return first.allgather_bytes(bytes([rank])), second.allgather_bytes(bytes([10 + rank])), \
            (first._namespace, second._namespace)
    out = {}
    followers = [threading.Thread(target=lambda r=r: out.__setitem__(r, _threads.call_or_error(lambda: rank_fn(r))))
                 for r in (1, 2)]
    for thread in followers:
        thread.start()
    agent.wait(["mooncake_ep/1/c/0/2"])  # rank 2 joined the attempt of the rank 0 that is gone
    out[0] = rank_fn(0)
    for thread in followers:
        thread.join(PROCESS_LIMIT_S)
    assert [out[r] for r in range(3)] == [([b"\0", b"\1", b"\2"], [b"\n", b"\x0b", b"\x0c"],
                                           ("mooncake_ep/2/", "mooncake_ep/3/"))] * 3, out
    # Alone, a rank > 0 names rank 0, which never opened the next attempt.
    with pytest.raises(GroupError, match=r"^init_group #0 timed out after 0\.3 s waiting for ranks \[0\] of 3 "
                                         r"\(torch TCPStore, keys mooncake_ep/4/\*\)$"):
        _group_adapters.torchrun_store_group(2, 3, "127.0.0.1", port, timeout_s=0.3)
    del agent


def _torchrun_group(port: int, rank: int, world_size: int, timeout_s: float):
    from mooncake_ep import _group_adapters
    return _group_adapters.torchrun_store_group(rank, world_size, "127.0.0.1", port, timeout_s=timeout_s)


def test_torchrun_ranks_of_another_world_size_are_named_at_once(clean_env):
    """Rank 0 of 3 and a rank 1 of 2: rank 1 learns the mismatch from rank 0's pair at once (rank 0 sets
    it as it opens its join attempt), and rank 0, at its timeout, names it from rank 1's slot of the
    round rather than a plain timeout (helper-109: both had become plain timeouts)."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    out = run_in_threads([lambda: _torchrun_group(port, 0, 3, 1.5), lambda: _torchrun_group(port, 1, 2, 1.5)])
    for error in out:
        assert isinstance(error, RankMismatchError), out
        assert str(error).startswith("init_group: ranks disagree on world_size (rank 0: 3, rank 1: 2)"), out
    assert "waiting for ranks [2] of 3" in str(out[0]), out
    del agent


def test_torchrun_groups_built_at_once_by_threads_of_each_rank_both_form(clean_env):
    """Two threads of each rank build a group at once, each with a store client of its own: a rank builds
    its groups one at a time, so each thread takes one attempt of rank 0 (helper-109: both threads of
    rank 1 took the first group's)."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    groups = run_in_threads([lambda r=r: _torchrun_group(port, r, 2, LONG_TIMEOUT_S) for r in (0, 1, 0, 1)])
    assert all(isinstance(g, TorchStoreGroup) for g in groups), groups
    namespaces = [g._namespace for g in groups]
    assert sorted(namespaces[0::2]) == sorted(namespaces[1::2]) and len(set(namespaces)) == 2, namespaces
    del agent


def _connections_to(port: int) -> int:
    """TCP connections of this process whose remote end is ``port`` (its sockets in /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()  # sl, local_address, rem_address, st, ..., inode (10th)
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                count += 1
    return count


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads this process's sockets from /proc")
def test_a_closed_torchrun_group_holds_no_connection_to_the_store(clean_env):
    """The store client torchrun_store_group connects is the group's own: close() hung up nothing and the
    process kept one socket to torchrun's agent per group it had ever built."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    before = _connections_to(port)  # the agent's own client of its server
    groups = run_in_threads([lambda r=r: _torchrun_group(port, r, 2, LONG_TIMEOUT_S) for r in range(2)])
    assert _connections_to(port) == before + 2
    run_in_threads([group.close for group in groups])
    assert _connections_to(port) == before
    assert "store=TCPStore" in repr(groups[0])
    with pytest.raises(GroupError, match="the group is closed"):
        groups[0].barrier()
    del agent


def test_a_torchrun_collective_waiting_while_its_group_closes_raises_group_error(clean_env):
    """close(final_barrier=False) on another thread (an abort path) while a collective waits: the collective
    raises GroupError naming the closed group (it died with AttributeError on the store set to None)."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    groups = run_in_threads([lambda r=r: _torchrun_group(port, r, 2, LONG_TIMEOUT_S) for r in range(2)])
    groups[0].timeout_s = 2.0  # rank 1 never calls: rank 0's wait ends after this long (close() must come first)
    out = []
    waiting = threading.Thread(target=lambda: out.append(_threads.call_or_error(
        lambda: groups[0].allgather_bytes(b"x"))))
    waiting.start()
    agent.wait([groups[0]._collective_key(0, 0)])  # rank 0 is in its collective
    groups[0].close(final_barrier=False)
    waiting.join()
    assert isinstance(out[0], GroupError) and "the group is closed" in str(out[0]), out
    groups[1].close(final_barrier=False)
    del agent


def test_a_torchrun_rank_0_that_finds_another_leading_says_so(clean_env):
    """A second process started as rank 0 opens the next attempt, closing the first one's: the first, still
    waiting for its ranks, raises naming the cause instead of timing out."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    out = []
    first = threading.Thread(target=lambda: out.append(_threads.call_or_error(
        lambda: _torchrun_group(port, 0, 2, LONG_TIMEOUT_S))))
    first.start()
    agent.wait(["mooncake_ep/1/init/world_size"])
    other = dist.TCPStore("127.0.0.1", port, None, False)  # the other process's connection
    with pytest.raises(GroupError, match=r"waiting for ranks \[1\] of 2 \(torch TCPStore, keys mooncake_ep/2/\*\)"):
        TorchStoreGroup(other, 0, 2, timeout_s=SHORT_TIMEOUT_S)
    first.join(PROCESS_LIMIT_S)
    assert isinstance(out[0], GroupError), out
    assert str(out[0]).startswith("init_group: rank 0 joined the store (torch TCPStore, keys mooncake_ep/1/*) twice: "
                                  "another process leads as rank 0"), out
    del agent


# ----------------------------------------------------------------------------- torch stores, threads


def test_torch_store_group_in_threads():
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    groups = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 3, timeout_s=LONG_TIMEOUT_S) for r in range(3)])
    assert all(isinstance(g, TorchStoreGroup) and isinstance(g, Group) for g in groups), groups
    for i in range(4):
        got = run_in_threads([lambda g=g: g.allgather_bytes(payload(g.rank, i)) for g in groups])
        assert got == [[payload(r, i) for r in range(3)]] * 3
    assert run_in_threads([g.barrier for g in groups]) == [None] * 3
    # A second set of groups on the same store does not see the first one's keys.
    again = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 3, timeout_s=LONG_TIMEOUT_S) for r in range(3)])
    assert run_in_threads([lambda g=g: g.allgather_bytes(b"2nd") for g in again]) == [[b"2nd"] * 3] * 3
    # Rank 1 does not call: ranks 0 and 2 name it, and refuse further calls.
    for g in groups:
        g.timeout_s = SHORT_TIMEOUT_S
    out = run_in_threads([lambda: groups[0].allgather_bytes(b"a"), lambda: groups[2].barrier()])
    for e in out:
        assert isinstance(e, GroupError), out
        assert f"timed out after {SHORT_TIMEOUT_S} s waiting for ranks [1] of 3 (torch HashStore" in str(e)
    with pytest.raises(GroupError, match="broken by an earlier failure"):
        groups[0].barrier()
    run_in_threads([lambda g=g: g.close() for g in again])
    with pytest.raises(GroupError, match="closed"):
        again[0].barrier()


def test_a_torch_store_groups_renewal_timeout_gives_advice_it_can_follow():
    """A renewal that times out on a torch store named init_group(rejoin=True), which torch stores refuse
    (no process can take a rank over there); TCPGroup's keeps that advice (helper-87)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    groups = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_TIMEOUT_S) for r in range(2)])
    groups[0].timeout_s = SHORT_TIMEOUT_S
    with pytest.raises(GroupError, match=r"renew_membership #0 \(epoch 1\) timed out .* waiting for ranks \[1\] of 2 "
                                         r".*every rank must call Buffer.update_ep_member\(\) \(or "
                                         r"group.renew_membership\(\)\) again, or, where a rank's process died, the "
                                         r"job builds a new group") as info:
        groups[0].renew_membership()
    assert "rejoin=True)" not in str(info.value).split("(only TCPGroup")[0]
    assert not TorchStoreGroup._takes_replacements and TCPGroup._takes_replacements


def test_torch_store_group_over_a_file_store_names_the_ranks_it_waited_for(tmp_path):
    """torch's FileStore ends a wait that ran out of time with a bare RuntimeError, not the DistStoreError
    of its other stores: the group said only "torch store wait failed: RuntimeError: Wait timeout"."""
    dist = pytest.importorskip("torch.distributed")
    store, timeout_s = dist.FileStore(str(tmp_path / "store"), 2), 0.1
    with pytest.raises(GroupError, match=rf"^init_group #0 timed out after {timeout_s} s waiting for ranks \[1\] of 2 "
                                         rf"\(torch FileStore, keys mooncake_ep/1/\*\)$"):
        TorchStoreGroup(store, 0, 2, timeout_s=timeout_s)  # rank 1 never comes
    groups = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_TIMEOUT_S, prefix="formed")
                             for r in range(2)])
    assert run_in_threads([lambda g=g: g.allgather_bytes(bytes([g.rank])) for g in groups]) == [[b"\0", b"\1"]] * 2
    groups[0].timeout_s = timeout_s
    with pytest.raises(GroupError, match=rf"^barrier #0 timed out after {timeout_s} s waiting for ranks \[1\] of 2 "
                                         rf"\(torch FileStore, keys formed/1/\*\)$"):
        groups[0].barrier()  # rank 1 does not call


@pytest.mark.parametrize("prefixed", [False, True], ids=["file_store", "prefix_store_over_it"])
def test_torch_store_group_over_a_file_store_waits_to_its_timeout_not_the_next_second(tmp_path, monkeypatch,
                                                                                      prefixed):
    """torch's FileStore.wait truncates the time waited to whole seconds before comparing it with the limit:
    a barrier of timeout_s = 2.0 ended after 3 s, a renewal (two waits) after 4. The group polls the keys
    itself, to the limit; on a clock of the test's own, which only the polls' sleeps move."""
    dist = pytest.importorskip("torch.distributed")
    from mooncake_ep import _group_adapters
    store = dist.FileStore(str(tmp_path / "store"), 2)
    if prefixed:
        store = dist.PrefixStore("outer", dist.PrefixStore("inner", store))
    groups = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_TIMEOUT_S) for r in range(2)])
    now = [1000.0]

    def sleep(seconds):
        now[0] += seconds

    monkeypatch.setattr(_group_adapters, "time", types.SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    groups[0].timeout_s = 2.0
    with pytest.raises(GroupError, match=r"^barrier #0 timed out after 2\.0 s waiting for ranks \[1\] of 2"):
        groups[0].barrier()  # rank 1 does not call
    assert now[0] - 1000.0 == pytest.approx(2.0, abs=0.011)


def test_torch_store_group_over_a_file_store_names_a_store_error_while_it_waits(tmp_path, monkeypatch):
    """A FileStore whose file stops being one while a rank polls it: the error is the store's, once, as
    when torch's own wait raised it (helper-104: it read "wait failed: GroupError: torch store check
    failed: ...")."""
    dist = pytest.importorskip("torch.distributed")
    from mooncake_ep import _group_adapters
    path = tmp_path / "store"
    store = dist.FileStore(str(path), 2)
    groups = run_in_threads([lambda r=r: TorchStoreGroup(store, r, 2, timeout_s=LONG_TIMEOUT_S) for r in range(2)])

    def sleep(seconds):  # the first poll found rank 1's key missing: the file becomes a folder
        if path.is_file():
            path.unlink()
            path.mkdir()

    monkeypatch.setattr(_group_adapters, "time", types.SimpleNamespace(monotonic=lambda: 0.0, sleep=sleep))
    with pytest.raises(GroupError, match=r"^barrier #0 on rank 0 failed: torch store check failed: DistStoreError: "
                                         r"Is a directory") as info:
        groups[0].barrier()  # rank 1 does not call
    assert "wait failed" not in str(info.value)
    path.rmdir()  # a file again: torch's FileStore aborts the process if its destructor finds a folder
    path.touch()


def test_torch_store_group_duplicate_rank_and_bad_input():
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    # Two threads building a group as rank 0 of 2 on one store object: they join one after the other (as a
    # process builds its groups), each in an attempt of its own, and each names the rank 1 that never comes.
    # (Two processes as one rank: test_group_join.py.)
    out = run_in_threads([lambda: TorchStoreGroup(store, 0, 2, timeout_s=SHORT_TIMEOUT_S)] * 2)
    assert all(isinstance(e, GroupError) and "waiting for ranks [1] of 2" in str(e) for e in out), out
    with pytest.raises(TypeError, match="store must be a torch.distributed.Store, got dict"):
        TorchStoreGroup({}, 0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\)"):
        TorchStoreGroup(store, 2, 2)
    solo = TorchStoreGroup(store, 0, 1)
    assert solo.allgather_bytes(b"x") == [b"x"] and solo.barrier() is None


@pytest.mark.parametrize("version", [4, 8])
def test_a_rank_0_of_an_older_store_protocol_is_named_by_its_version(version):
    """Rank 0 of an older store protocol takes its keys from its own count of its groups, and writes no
    join attempt: a rank of this version, waiting for rank 0 to open one, names its version, at once
    from its init key (protocols 5 to 8) or, when its wait ends, from its slot of round 0 (protocol 4,
    which writes no init key; the adapters' stores have no hello)."""
    dist = pytest.importorskip("torch.distributed")
    from mooncake_ep import _group_common

    class OlderRank0(TorchStoreGroup):
        def _rendezvous(self, deadline=None):  # its count names its keys; then the init key, the claim, the round
            self._namespace = f"mooncake_ep/{self.store.add('mooncake_ep/groups/0', 1)}/"
            pair = _group_common._INIT.pack(version, self.world_size)
            if version >= 5:
                self.store.set(self._init_key(), pair)
            self.store.add(f"{self._namespace}claim/0", 1)
            self._collective("init_group", pair)

    store = dist.HashStore()
    out = run_in_threads([lambda: OlderRank0(store, 0, 2, timeout_s=SHORT_TIMEOUT_S),
                          lambda: TorchStoreGroup(store, 1, 2, timeout_s=SHORT_TIMEOUT_S)])
    assert isinstance(out[1], RankMismatchError), out
    named = (f"init_group: ranks disagree on the store protocol (rank 0: {version}, rank 1: "
             f"{_group_common._PROTOCOL_VERSION}): every rank must run the same mooncake_ep version")
    assert str(out[1]) == named if version >= 5 else str(out[1]).startswith(f"{named}; init_group #0 timed out after")


def test_a_rank_of_an_older_store_protocol_is_named_by_its_version():
    """A rank 1 of protocol 8 takes its keys from its own count of its groups: on the first group, those of
    rank 0's first attempt, where it reads rank 0's pair and raises naming both versions, and leaves its
    own pair in its slot, from which rank 0 names them when its wait ends."""
    dist = pytest.importorskip("torch.distributed")
    from mooncake_ep import _group_common

    class OlderRank1(TorchStoreGroup):
        def _rendezvous(self, deadline=None):  # its count names its keys; then rank 0's pair, read first
            self._namespace = f"mooncake_ep/{self.store.add('mooncake_ep/groups/1', 1)}/"
            self._check_rank0(_group_common._INIT.pack(8, self.world_size), deadline)

    store = dist.HashStore()
    out = run_in_threads([lambda: TorchStoreGroup(store, 0, 2, timeout_s=SHORT_TIMEOUT_S),
                          lambda: OlderRank1(store, 1, 2, timeout_s=SHORT_TIMEOUT_S)])
    named = (f"init_group: ranks disagree on the store protocol (rank 0: {_group_common._PROTOCOL_VERSION}, "
             f"rank 1: 8): every rank must run the same mooncake_ep version")
    assert all(isinstance(e, RankMismatchError) and str(e).startswith(named) for e in out), out


def test_torch_group_refuses_uninitialised_torch_distributed():
    dist = pytest.importorskip("torch.distributed")
    assert not dist.is_initialized()
    with pytest.raises(GroupError, match=r"not initialised; call torch.distributed.init_process_group"):
        TorchGroup()
    with pytest.raises(GroupError, match="not initialised"):
        init_group("torch")


def test_torch_group_over_a_destroyed_process_group_and_a_sub_millisecond_barrier(monkeypatch):
    """torch raises ValueError, not RuntimeError, once the default group is destroyed: it escaped as is
    where callers catch GroupError. And torch keeps a barrier's timeout in whole milliseconds, where
    gloo takes 0 as no limit: a timeout_s under 1 ms waited forever for a live peer (helper-156)."""
    dist = pytest.importorskip("torch.distributed")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = TorchGroup(timeout_s=0.0005)
        timeouts = []
        real_barrier = dist.monitored_barrier
        monkeypatch.setattr(dist, "monitored_barrier", lambda group=None, timeout=None, wait_all_ranks=False: (
            timeouts.append(timeout), real_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks))[1])
        group.barrier()
        assert timeouts[0].total_seconds() >= 0.001, timeouts
        subgroup = TorchGroup(dist.new_group([0]))
    finally:
        dist.destroy_process_group()
    with pytest.raises(GroupError, match=r"allgather_bytes #0 on rank 0: torch.distributed.all_gather \(gloo\) "
                                         r"failed: ValueError"):
        group.allgather_bytes(b"x")
    # torch numbers a subgroup's ranks within it: its failures say which global ranks those are.
    with pytest.raises(GroupError, match=r"torch.distributed barrier \(gloo; a subgroup: its ranks 0..0 are global "
                                         r"ranks \[0\]\) failed"):
        subgroup.barrier()


# ----------------------------------------------------------------------------- mpi4py, a fake communicator


class FakeComm:
    """The mpi4py methods MPIGroup uses, for ranks that are threads; objects are pickled as mpi4py does."""

    def __init__(self, world: dict, rank: int) -> None:
        self.world, self.rank = world, rank

    @classmethod
    def world(cls, size: int) -> list[FakeComm]:
        world = {"size": size, "barrier": threading.Barrier(size, timeout=LONG_TIMEOUT_S), "slots": [None] * size}
        return [cls(world, r) for r in range(size)]

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.world["size"]

    def allgather(self, obj):
        self.world["slots"][self.rank] = pickle.dumps(obj)
        self.world["barrier"].wait()
        out = [pickle.loads(blob) for blob in self.world["slots"]]
        self.world["barrier"].wait()  # nobody overwrites a slot before everyone has read it
        return out

    def Barrier(self) -> None:  # noqa: N802
        self.world["barrier"].wait()


def test_mpi_group_over_fake_communicator():
    comms = FakeComm.world(3)
    groups = [init_group(comm, device=comm.rank) for comm in comms]
    assert all(isinstance(g, MPIGroup) and isinstance(g, Group) for g in groups)
    assert [(g.rank, g.world_size, g.device, g.is_in_process) for g in groups] == [(r, 3, r, False) for r in range(3)]
    for i in range(3):
        got = run_in_threads([lambda g=g: g.allgather_bytes(payload(g.rank, i)) for g in groups])
        assert got == [[payload(r, i) for r in range(3)]] * 3
    assert run_in_threads([g.barrier for g in groups]) == [None] * 3


def test_mpi_group_errors_break_the_group():
    class FailingComm(FakeComm):
        def Barrier(self) -> None:  # noqa: N802
            raise RuntimeError("MPI_ERR_OTHER: simulated")

    (comm,) = FailingComm.world(1)
    group = MPIGroup(comm)
    with pytest.raises(GroupError, match=r"barrier #0 on rank 0: MPI Barrier failed: RuntimeError: MPI_ERR_OTHER"):
        group.barrier()
    with pytest.raises(GroupError, match="broken by an earlier failure"):
        group.allgather_bytes(b"x")

    class StrayComm(FakeComm):  # a peer in another collective: mpi4py hands back whatever it sent
        def allgather(self, obj):
            return [("not", "bytes")]

    (comm,) = StrayComm.world(1)
    with pytest.raises(GroupError, match="expected a list of 1 bytes"):
        MPIGroup(comm).allgather_bytes(b"x")
    with pytest.raises(TypeError, match="comm must be an mpi4py communicator, got object"):
        MPIGroup(object())
    with pytest.raises(TypeError, match="data must be bytes"):
        MPIGroup(FakeComm.world(1)[0]).allgather_bytes("text")


def test_an_mpi_intercommunicator_or_others_bytes_are_refused():
    """An intercommunicator's rank and size are its local group's, its allgather the remote group's
    objects: of equal sizes every rank got the other side's bytes, and no error (helper-156)."""
    class InterComm(FakeComm):
        def Is_inter(self) -> bool:  # noqa: N802
            return True

    with pytest.raises(ValueError, match=r"comm is an intercommunicator, .* \(comm.Merge\(\)\)"):
        MPIGroup(InterComm.world(1)[0])

    class RemoteComm(FakeComm):  # what such a communicator's allgather gives: bytes, not this rank's
        def allgather(self, obj):
            return [b"the other group's"]

    with pytest.raises(GroupError, match="expected a list of 1 bytes with this rank's own at 0"):
        MPIGroup(RemoteComm.world(1)[0]).allgather_bytes(b"x")


def test_mpi_group_stopped_inside_a_collective_is_broken_and_a_failed_final_barrier_still_closes(caplog):
    """Any exception inside a collective (an interrupt, a watchdog's TimeoutError), not only the library's
    RuntimeError, leaves the ranks' calls unpaired: the group is broken, as the store groups are. A final
    barrier that fails in close() is logged, and the group closes all the same (helper-87)."""
    class InterruptedComm(FakeComm):
        def allgather(self, obj):
            raise TimeoutError("a watchdog's")

    (comm,) = InterruptedComm.world(1)
    group = MPIGroup(comm)
    with pytest.raises(TimeoutError):
        group.allgather_bytes(b"x")
    with pytest.raises(GroupError, match=r"allgather_bytes #1: the group is broken by an earlier failure "
                                         r"\(allgather_bytes #0 on rank 0: MPI allgather failed: TimeoutError"):
        group.allgather_bytes(b"x")

    class FailingBarrier(FakeComm):
        def Barrier(self) -> None:  # noqa: N802
            raise RuntimeError("MPI_ERR_OTHER: simulated")

    (comm,) = FailingBarrier.world(1)
    group = MPIGroup(comm)
    with caplog.at_level(logging.WARNING, logger="mooncake_ep"):
        group.close(final_barrier=True)
    assert "the final barrier of close() failed" in caplog.text
    with pytest.raises(GroupError, match="the group is closed"):
        group.allgather_bytes(b"x")


def test_timeouts_the_groups_take_as_forever_stay_finite_and_long_for_torch_and_mpi():
    """math.inf and anything from 1e8 s on wait forever (group._wait_arg); torch's millisecond timedelta
    arithmetic had timed out at once for 1e10 s and overflowed for 1e15."""
    from mooncake_ep import _group_adapters

    for forever in (math.inf, 1e8, 1e10, 1e15):
        assert _group_adapters._finite_s(forever) == _group_adapters._FOREVER_S
    assert _group_adapters._finite_s(5.0) == 5.0


MPI_WORKER = textwrap.dedent("""
    import json, pathlib, sys
    from mpi4py import MPI
    from mooncake_ep.group import init_group
    group = init_group()  # mpi4py.MPI imported, more than one process: MPIGroup over COMM_WORLD
    out = [type(group).__name__, [v.hex() for v in group.allgather_bytes(bytes([group.rank]) * group.rank)]]
    group.barrier()
    pathlib.Path(sys.argv[1], f"rank{group.rank}.json").write_text(json.dumps(out))  # mpiexec merges stdout
""")


# The MPICH wheel puts mpiexec beside the interpreter, which PATH lacks unless the venv is activated.
MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
                    reason="needs mpi4py and an MPI launcher (mpiexec); the test extra installs both on Linux")
def test_mpi_group_real_mpi(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", MPI_WORKER, str(tmp_path)], cwd=REPO_ROOT,
                          env={**env, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True,
                          timeout=PROCESS_LIMIT_S)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [["MPIGroup", ["", "01"]]] * 2


# ----------------------------------------------------------------------------- jax.distributed


JAX_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    from mooncake_ep.group import GroupError, init_group

    port, rank, world_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world_size,
                               process_id=rank, initialization_timeout=60)
    from jax._src import distributed
    out = {}
    group = init_group(timeout_s=30.0)  # no RANK/WORLD_SIZE: the initialised jax.distributed
    out["default"] = [type(group).__name__, group.rank, group.world_size]
    out["rounds"] = [[v.hex() for v in group.allgather_bytes(bytes([rank]) * (rank + i))] for i in range(3)]
    group.barrier()
    second = init_group("jax", timeout_s=30.0)  # its own keys: the two groups do not mix
    out["second"] = [v.hex() for v in second.allgather_bytes(b"2nd")]
    if rank == 0:
        second.timeout_s = float(sys.argv[4])
        try:
            second.allgather_bytes(b"late")
        except GroupError as exc:
            out["timeout"] = str(exc)
    distributed.global_state.client.wait_at_barrier("test_done", 60_000)
    print(json.dumps(out), flush=True)
    jax.distributed.shutdown()
""")


def test_jax_distributed_two_processes():
    pytest.importorskip("jax")
    port, world_size = free_port(), 2
    out = launch(JAX_WORKER, [{"JAX_PLATFORMS": "cpu"}] * world_size,
                 [[str(port), str(r), str(world_size), str(SHORT_TIMEOUT_S)] for r in range(world_size)])
    for rank, result in enumerate(out):
        assert result["default"] == ["JaxGroup", rank, world_size]
        assert result["rounds"] == [[(bytes([r]) * (r + i)).hex() for r in range(world_size)] for i in range(3)]
        assert result["second"] == [b"2nd".hex()] * world_size
    assert out[0]["timeout"].startswith(f"allgather_bytes #1 timed out after {SHORT_TIMEOUT_S} s waiting for "
                                        f"ranks [1] of 2 (jax.distributed key-value store, keys mooncake_ep/2/*)")


class FakeJaxClient:
    """jax's DistributedRuntimeClient key-value methods over a dict shared by threads."""

    def __init__(self, shared: dict) -> None:
        self.shared = shared

    @staticmethod
    def make_shared() -> dict:
        return {"data": {}, "cond": threading.Condition()}

    def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None:
        with self.shared["cond"]:
            if key in self.shared["data"] and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.shared["data"][key] = bytes(value)
            self.shared["cond"].notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes:
        with self.shared["cond"]:
            if not self.shared["cond"].wait_for(lambda: key in self.shared["data"], timeout=timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.shared["data"][key]

    def key_value_try_get_bytes(self, key: str) -> bytes:
        with self.shared["cond"]:
            if key not in self.shared["data"]:
                raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return self.shared["data"][key]

    def key_value_increment(self, key: str, increment: int) -> int:
        with self.shared["cond"]:
            value = int(self.shared["data"].get(key, b"0")) + increment
            if not -2**31 <= value < 2**31:  # the coordination service parses its counters as int32
                raise RuntimeError(f'FAILED_PRECONDITION: Failed to parse value "{value}" as an integer.')
            self.shared["data"][key] = str(value).encode()
            return value

    def key_value_delete(self, key: str) -> None:
        with self.shared["cond"]:
            self.shared["data"].pop(key, None)


def test_jax_group_over_fake_client():
    shared = FakeJaxClient.make_shared()
    make = [lambda r=r: JaxGroup(FakeJaxClient(shared), rank=r, world_size=3, timeout_s=LONG_TIMEOUT_S)
            for r in range(3)]
    groups = run_in_threads(make)
    assert all(isinstance(g, JaxGroup) and isinstance(g, Group) for g in groups), groups
    for i in range(3):
        got = run_in_threads([lambda g=g: g.allgather_bytes(payload(g.rank, i)) for g in groups])
        assert got == [[payload(r, i) for r in range(3)]] * 3
    assert run_in_threads([g.barrier for g in groups]) == [None] * 3
    assert len(shared["data"]) < 20, "each rank deletes its key of the call before the last one"
    for g in groups:
        g.timeout_s = SHORT_TIMEOUT_S
    out = run_in_threads([lambda: groups[1].allgather_bytes(b"a"), lambda: groups[2].allgather_bytes(b"c")])
    for e in out:
        assert isinstance(e, GroupError), out
        assert str(e).startswith(f"allgather_bytes #3 timed out after {SHORT_TIMEOUT_S} s waiting for ranks [0] of 3 "
                                 f"(jax.distributed key-value store, keys mooncake_ep/1/*)")


def test_jax_group_errors():
    class OldClient:  # a jax whose private client lacks what the adapter calls
        def key_value_set(self, key, value):
            pass

    with pytest.raises(GroupError, match=r"has no \['key_value_set_bytes', .*use init_group\(\) with RANK"):
        JaxGroup(OldClient(), rank=0, world_size=2)
    with pytest.raises(ValueError, match="pass rank and world_size"):
        JaxGroup(FakeJaxClient(FakeJaxClient.make_shared()))
    pytest.importorskip("jax")
    with pytest.raises(GroupError, match=r"jax.distributed is not initialised; call jax.distributed.initialize"):
        init_group("jax")

    class DeadClient(FakeJaxClient):
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            raise RuntimeError("UNAVAILABLE: coordination service is gone")

        def key_value_try_get_bytes(self, key):
            raise RuntimeError("UNAVAILABLE: coordination service is gone")

    with pytest.raises(GroupError, match="key-value get of 'mooncake_ep/1/c/0/0' failed: RuntimeError: UNAVAILABLE"):
        JaxGroup(DeadClient(FakeJaxClient.make_shared()), rank=0, world_size=2)


# ----------------------------------------------------------------------------- init_group's choice


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_init_group_argument_errors(clean_env):
    (comm,) = FakeComm.world(1)
    with pytest.raises(TypeError, match=r"group must be None, a torch ProcessGroup or Store, .*got builtins.int"):
        init_group(3)
    with pytest.raises(ValueError, match=r"group must be one of \['tcp', 'torch', 'jax'\] when a str, got 'nccl'"):
        init_group("nccl")
    with pytest.raises(ValueError, match="master_port configures the TCP store; with group=.*FakeComm leave it out"):
        init_group(comm, master_port=29500)
    with pytest.raises(ValueError, match="rank=1 differs from the group's rank 0"):
        init_group(comm, rank=1)
    with pytest.raises(ValueError, match="RANK is not set.*or pass init_group\\(group=...\\) a torch ProcessGroup"):
        init_group("tcp")
    assert isinstance(init_group("tcp", rank=0, world_size=1), TCPGroup)
    # Values out of range that came from the environment name the variables the caller set.
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 5 \(read from the "
                                         r"environment: RANK=5, WORLD_SIZE=2\)"):
        init_group()
    clean_env.setenv("RANK", "0")
    clean_env.setenv("MASTER_PORT", "99999")
    with pytest.raises(ValueError, match=r"master_port must be in \[1, 65535\], got 99999 \(read from the "
                                         r"environment: MASTER_PORT=99999\)"):
        init_group()
    # A bad argument beside values from the environment is the argument's, named alone.
    with pytest.raises(ValueError, match=r"master_port must be >= 1, got 0$"):
        init_group("tcp", master_port=0)


def test_init_group_returns_an_existing_group():
    rank_group = LocalGroup(2).rank_group(1)
    assert init_group(rank_group) is rank_group
    with pytest.raises(ValueError, match="world_size=3 differs"):
        init_group(rank_group, world_size=3)

    class FourMembers:  # all a Group needs (as the Buffer takes it): no is_in_process, no device
        rank, world_size = 0, 1

        def allgather_bytes(self, data):
            return [data]

        def barrier(self):
            pass
    group = FourMembers()
    assert isinstance(group, Group) and init_group(group) is group
    import mooncake_ep as ep
    ep.Buffer(group, 1 << 20, backend="reference").destroy()


def test_init_group_detects_initialised_jax_distributed(clean_env):
    # jax.distributed's state as a one-process initialize() leaves it; detection only reads sys.modules.
    state = types.SimpleNamespace(client=FakeJaxClient(FakeJaxClient.make_shared()), process_id=0, num_processes=1)
    clean_env.setitem(sys.modules, "jax._src.distributed", types.SimpleNamespace(global_state=state))
    group = init_group()
    assert isinstance(group, JaxGroup) and (group.rank, group.world_size) == (0, 1)
    # Explicit TCP store arguments come first.
    assert isinstance(init_group(rank=0, world_size=1), TCPGroup)


def test_init_group_detects_mpi4py(clean_env):
    comms = FakeComm.world(2)
    fake_mpi = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False, COMM_WORLD=comms[0])
    clean_env.setitem(sys.modules, "mpi4py.MPI", fake_mpi)
    group = init_group()
    assert isinstance(group, MPIGroup) and group.comm is comms[0]


def test_a_process_outside_a_torch_subgroup_is_told_so(clean_env):
    """torch's new_group gives the ranks it leaves out GroupMember.NON_GROUP_MEMBER, an int: init_group
    and Buffer said 'got builtins.int' and 'int has no rank' (helper-156)."""
    dist = pytest.importorskip("torch.distributed")
    import mooncake_ep as ep

    outside = dist.GroupMember.NON_GROUP_MEMBER
    for build in (lambda: init_group(outside), lambda: ep.Buffer(outside, 1 << 20)):
        with pytest.raises(ValueError, match=r"group is torch.distributed.GroupMember.NON_GROUP_MEMBER .*: this "
                                             r"process is not a member of that group"):
            build()


def test_a_process_outside_an_mpi_split_is_told_so(clean_env):
    """mpi4py's Split gives the processes it leaves out MPI.COMM_NULL, whose methods raise MPI's own
    'null communicator' errors (helper-156)."""
    class Comm:  # mpi4py's Comm: compared by handle
        def __init__(self, handle):
            self.handle = handle

        def __eq__(self, other):
            return isinstance(other, Comm) and other.handle == self.handle

        __hash__ = object.__hash__

    class Intracomm(Comm, FakeComm):  # what Split gives a process it leaves out: an Intracomm of the null handle
        pass

    fake_mpi = types.SimpleNamespace(Is_initialized=lambda: True, Is_finalized=lambda: False, COMM_NULL=Comm(0))
    clean_env.setitem(sys.modules, "mpi4py.MPI", fake_mpi)
    split_null = Intracomm(0)
    for build in (lambda: init_group(fake_mpi.COMM_NULL), lambda: init_group(split_null)):
        with pytest.raises(ValueError, match=r"group is mpi4py's MPI.COMM_NULL .*: this process is not a member"):
            build()
    with pytest.raises(ValueError, match=r"MPIGroup: comm is mpi4py's MPI.COMM_NULL"):
        MPIGroup(split_null)
