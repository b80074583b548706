"""The whole bootstrap with real processes: init_group() over the TCP store, Buffer on the reference backend.

Each rank is a process started as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs
this module's :func:`worker_main`, and saves its outputs. Every process builds the same global inputs
from one seed, so the test compares each rank's dispatch (bit for bit up to recv_count; rows past it
are undefined) and combine (bit for bit: the backend is the reference) with mooncake_ep.reference run
here on those global inputs. Inputs encode their origin: channel 0 of rank s's token t holds s and
channel 1 holds t (exact in bf16), so a misrouted row names its source.

CPU only; no assertion is about elapsed time, the process limit only turns a hang into a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _ep_processes import bits, expert_fn  # one definition for both process tests

from mooncake_ep import reference
from mooncake_ep.cli.launch import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
# Safety net for a test process that hangs (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 90.0
# How long the collectives wait when every peer is expected: generous, it only bounds a failure.
LONG_TIMEOUT_S = 60.0
# How long they wait when a peer is expected to be missing.
SHORT_TIMEOUT_S = 1.0
# How long init_group waits when a peer is expected to be missing: the processes that do start must
# all be up by then, so it allows for a slow start on a loaded machine.
JOIN_TIMEOUT_S = 5.0
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")

# One configuration per precision: (name, dispatch flags).
PRECISIONS = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True)}
NUM_MAX_TOKENS = 6
HIDDEN = 256
NUM_TOPK = 3
EXPERTS_PER_RANK = 2
# Share of top-k entries set to -1 (no expert).
NO_EXPERT_SHARE = 0.2


# ----------------------------------------------------------------------------- shared by test and workers


def make_inputs(seed: int, num_ranks: int) -> dict[str, list[np.ndarray]]:
    """Every rank's x ``[t_r, HIDDEN]`` bf16, topk_idx ``[t_r, NUM_TOPK]`` int64 and weights fp32.

    Token counts differ between ranks (rank 0 sends the maximum; with more than two ranks, the last
    sends none) and some entries are -1.
    """
    rng = np.random.default_rng(seed)
    num_experts = EXPERTS_PER_RANK * num_ranks
    xs, topk_idxs, weights = [], [], []
    for rank in range(num_ranks):
        t = int(rng.integers(1, NUM_MAX_TOKENS + 1))
        t = NUM_MAX_TOKENS if rank == 0 else 0 if rank == num_ranks - 1 > 1 else t
        x = rng.standard_normal((t, HIDDEN)).astype(np.float32)
        x[:, 0], x[:, 1] = rank, np.arange(t)
        xs.append(x.astype(reference.bfloat16))
        idx = np.array([rng.permutation(num_experts)[:NUM_TOPK] for _ in range(t)], np.int64).reshape(t, NUM_TOPK)
        idx[rng.random(idx.shape) < NO_EXPERT_SHARE] = -1
        topk_idxs.append(idx)
        weights.append(rng.uniform(-1, 1, size=(t, NUM_TOPK)).astype(np.float32))
    return {"xs": xs, "topk_idxs": topk_idxs, "weights": weights}


def worker_main(argv: list[str]) -> None:
    """One rank, started with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. ``argv``:
    ``run JOIN_TIMEOUT_S CALL_TIMEOUT_S SEED OUT_DIR`` (dispatch + combine in both precisions, save
    the outputs) or ``leave JOIN_TIMEOUT_S`` (join the group, then exit). Prints one JSON line."""
    import mooncake_ep as ep

    mode, join_timeout_s = argv[0], float(argv[1])
    try:
        group = ep.init_group(timeout_s=join_timeout_s)
        if mode == "leave":  # joins, then exits without taking part in any dispatch
            group.close(final_barrier=False)
            print(json.dumps({"rank": group.rank, "left": True}))
            return
        group.timeout_s = float(argv[2])
        seed, out_dir = int(argv[3]), Path(argv[4])
        rank, num_ranks = group.rank, group.world_size
        inputs = make_inputs(seed, num_ranks)
        num_experts = EXPERTS_PER_RANK * num_ranks
        size = ep.Buffer.get_ep_buffer_size_hint(NUM_MAX_TOKENS, HIDDEN, num_ranks, num_experts)
        buffer = ep.Buffer(group, size, backend="reference")
        x, topk_idx, weights = inputs["xs"][rank], inputs["topk_idxs"][rank], inputs["weights"][rank]
        saved = {}
        for name, flags in PRECISIONS.items():
            active_ranks = np.ones(num_ranks, np.int32)
            recv_x, recv_count, handle, _, _ = buffer.dispatch(x, topk_idx, active_ranks, NUM_MAX_TOKENS, num_experts,
                                                               **flags)
            q, scales = recv_x if flags["use_fp8"] else (recv_x, None)
            combined, _, _ = buffer.combine(expert_fn(rank, q, scales), topk_idx, weights, active_ranks, -1, handle)
            try:  # the kernels' peers in other processes read copies in the workspace: refused, as on a GPU
                buffer.combine(expert_fn(rank, q, scales), topk_idx, weights, active_ranks, -1, handle)
                saved[f"{name}_second_combine"] = "accepted"
            except RuntimeError as exc:
                saved[f"{name}_second_combine"] = str(exc)
            saved |= {f"{name}_recv_x": bits(q), f"{name}_recv_count": recv_count, f"{name}_combined": bits(combined),
                      f"{name}_active_ranks": active_ranks}
            if scales is not None:
                saved[f"{name}_recv_scales"] = scales
        buffer.destroy()
        np.savez(out_dir / f"rank{rank}.npz", **saved)
        group.close()
        print(json.dumps({"rank": rank, "ok": True}))
    except ep.GroupError as exc:
        print(json.dumps({"error": str(exc)}))


# ----------------------------------------------------------------------------- launching


def launch(world_size: int, argv_by_rank: dict[int, list[str]]) -> dict[int, dict]:
    """Run :func:`worker_main` as the given ranks of ``world_size`` (environment like torchrun's, a free
    port); return each rank's JSON line."""
    port = free_port()
    code = "import sys, test_buffer_multiprocess as t; t.worker_main(sys.argv[1:])"
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    procs = {}
    for rank, argv in argv_by_rank.items():
        env = {**base, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])}
        procs[rank] = subprocess.Popen([sys.executable, "-c", code, *argv], env=env, cwd=REPO_ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for rank, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=PROCESS_LIMIT_S)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}: {stderr}"
            out[rank] = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [2, 4])
def test_processes_equal_reference(world_size, tmp_path):
    seed = 1000 + world_size
    argv = ["run", str(LONG_TIMEOUT_S), str(LONG_TIMEOUT_S), str(seed), str(tmp_path)]
    out = launch(world_size, {r: argv for r in range(world_size)})
    assert out == {r: {"rank": r, "ok": True} for r in range(world_size)}

    inputs = make_inputs(seed, world_size)
    num_experts = EXPERTS_PER_RANK * world_size
    actives = [np.ones(world_size, np.int32)] * world_size
    for name, flags in PRECISIONS.items():
        results = [reference.dispatch(r, inputs["xs"], inputs["topk_idxs"], actives, NUM_MAX_TOKENS, num_experts,
                                      **flags) for r in range(world_size)]
        expert_outs = [expert_fn(r, res.recv_x, res.recv_scales) for r, res in enumerate(results)]
        for rank in range(world_size):
            got = np.load(tmp_path / f"rank{rank}.npz")
            ref = results[rank]
            where = f"{name}, rank {rank} of {world_size}"
            np.testing.assert_array_equal(got[f"{name}_recv_count"], ref.recv_count, err_msg=f"{where}: recv_count")
            assert got[f"{name}_recv_x"].shape == ref.recv_x.shape, where
            for e, count in enumerate(ref.recv_count):
                np.testing.assert_array_equal(got[f"{name}_recv_x"][e, :count], bits(ref.recv_x[e, :count]),
                                              err_msg=f"{where}: recv_x of local expert {e}")
                if ref.recv_scales is not None:
                    np.testing.assert_array_equal(got[f"{name}_recv_scales"][e, :count], ref.recv_scales[e, :count],
                                                  err_msg=f"{where}: recv_scales of local expert {e}")
            combined, _ = reference.combine(rank, expert_outs, results, inputs["topk_idxs"][rank],
                                            inputs["weights"][rank], actives)
            np.testing.assert_array_equal(got[f"{name}_combined"], bits(combined), err_msg=f"{where}: combined")
            np.testing.assert_array_equal(got[f"{name}_active_ranks"], np.ones(world_size, np.int32), err_msg=where)
            assert str(got[f"{name}_second_combine"]).startswith("combine: this handle was already combined through "
                                                                 "the workspace"), where
    if world_size > 2:  # the last rank sent no tokens, yet received rows (a rank without tokens is alive)
        last = np.load(tmp_path / f"rank{world_size - 1}.npz")
        assert last["bf16_combined"].shape == (0, HIDDEN) and sum(last["bf16_recv_count"]) > 0


def test_peer_that_never_joins_is_named(tmp_path):
    # Rank 2 of 3 is never started: ranks 0 and 1 give up in init_group, each when its own wait runs
    # out (rank 0 keeps its store up until rank 1 has hung up), naming it. The one whose wait runs
    # out second also names the other, which left first taking its slot with it, and says so.
    argv = ["run", str(JOIN_TIMEOUT_S), str(SHORT_TIMEOUT_S), "0", str(tmp_path)]
    out = launch(3, {0: argv, 1: argv})
    for rank, other in ((0, 1), (1, 0)):
        error = out[rank]["error"]
        assert error.startswith(f"init_group #0 timed out after {JOIN_TIMEOUT_S} s "), out
        assert ("waiting for ranks [2] of 3 (MASTER_ADDR=127.0.0.1" in error
                or (f"waiting for ranks [{other}, 2] of 3 (MASTER_ADDR=127.0.0.1" in error
                    and error.endswith(f"; of these, ranks [{other}] came and left (their own init_group failed "
                                       f"first)"))), out


def test_peer_that_joins_and_leaves_is_named_by_buffer_construction(tmp_path):
    # Rank 2 joins the group, then exits without building its Buffer: the others' Buffer()
    # (whose configuration check is the first collective after init_group) names it.
    argv = ["run", str(LONG_TIMEOUT_S), str(SHORT_TIMEOUT_S), "0", str(tmp_path)]
    out = launch(3, {0: argv, 1: argv, 2: ["leave", str(LONG_TIMEOUT_S)]})
    # Rank 2's claim went with its process: rank 0's wait ends at once, naming it (the other rank's slot
    # may not be there yet either). Rank 1's ends the same way, or, when rank 0 (which serves the store)
    # exits first, with the store gone; neither waits out its timeout.
    assert re.match(r"allgather_bytes #0 ended early waiting for ranks \[(1, )?2\] of 3 .*: ranks \[2\] left the group",
                    out[0]["error"]), out
    assert out[1]["error"].startswith("allgather_bytes #0 ") and "timed out" not in out[1]["error"], out
    assert out[2] == {"rank": 2, "left": True}
