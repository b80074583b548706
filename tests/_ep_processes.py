"""A test helper: Buffer steps in real processes joined by init_group() (TCP store), checked here.

Shared by test_buffer_membership.py (reference backend, CPU) and test_gpu_ipc.py (the kernels,
processes on one GPU through the ipc transport). Each worker is started as torchrun would start it
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), runs :func:`worker_main` and writes what it got to
files in the run's folder (launchers merge stdout); the test recomputes every step with
mooncake_ep.reference on the same inputs, which every process builds from one seed.

Inputs encode their origin: channel 0 of rank s's token t holds s and channel 1 holds t (exact in
bf16), so a misrouted row names its source. GPU outputs are poisoned first (NaN bf16, 0xFF fp8
bytes, -1 counts), so an element the kernels did not write cannot pass.

Scenarios (``worker_main``'s first argument):

- ``steps``: every rank runs one bf16 and one fp8 dispatch + combine; on the cuda backend also one
  fp8 step in each of the other launch modes (async, hook).
- ``mismatch``: the last rank's first dispatch has twice the others' hidden (every rank must
  raise ValueError, GPU only: the per-configuration check), then one fp8 step with the right one.
- ``member`` / ``victim`` / ``replacement``: step 0 with every rank; the victim then kills itself
  (SIGKILL: no cleanup, its sockets closed by the OS); step 1 on the survivors (GPU: the kernels
  mask it; reference: the group's collective names it); survivors call update_ep_member while the
  parent starts a replacement (``init_group(rejoin=True)`` + ``Buffer``); step 2 with every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from mooncake_ep import reference
from mooncake_ep.cli.launch import free_port  # noqa: F401 - the tests take it from here too (procs.free_port)

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
PRECISIONS = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True)}
# Launch modes besides sync that the "steps" scenario runs on the cuda backend (saved as fp8-MODE).
GPU_MODES = ("async", "hook")
# A command the launcher puts before each rank's python (shell words), e.g. compute-sanitizer and its
# options: a tool then runs in every rank's process of its own (scripts/gpu_check.sh's sanitizer stage).
# Meant for the steps and mismatch scenarios: under a tool, a victim's SIGKILL ends its python, and the
# launcher would read the tool's exit code instead of -SIGKILL.
RANK_PREFIX_VAR = "MOONCAKE_EP_TEST_RANK_PREFIX"
# Share of top-k entries set to -1 (no expert).
NO_EXPERT_SHARE = 0.2
# How long a GPU kernel waits for a live peer: processes on one GPU time-slice without MPS, so this
# is generous; a bug shows as a masked rank after 30 s, never as a hang. The sanitizer stage of
# scripts/gpu_check.sh raises it through the environment, as for test_gpu_low_latency (up to the
# launching test's own long timeout: worker_main takes the smaller).
KERNEL_TIMEOUT_US = int(os.environ.get("MOONCAKE_EP_TEST_TIMEOUT_US", 30_000_000))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One configuration: T tokens per rank at most, hidden, top-k, experts per rank."""

    num_max_tokens: int
    hidden: int
    num_topk: int
    experts_per_rank: int

    def num_experts(self, num_ranks: int) -> int:
        return self.experts_per_rank * num_ranks

    def to_arg(self) -> str:
        return ",".join(str(v) for v in dataclasses.astuple(self))

    @classmethod
    def from_arg(cls, arg: str) -> Shape:
        return cls(*(int(v) for v in arg.split(",")))


# ----------------------------------------------------------------------------- inputs and experts


def make_inputs(seed: int, num_ranks: int, shape: Shape) -> dict[str, list[np.ndarray]]:
    """Every rank's x ``[t_r, hidden]`` bf16, topk_idx ``[t_r, num_topk]`` int64, weights fp32.

    Rank 0 sends T tokens; with more than two ranks the last sends none; the others 1..T.
    """
    rng = np.random.default_rng(seed)
    num_experts = shape.num_experts(num_ranks)
    xs, topk_idxs, weights = [], [], []
    for rank in range(num_ranks):
        t = int(rng.integers(1, shape.num_max_tokens + 1))
        t = shape.num_max_tokens if rank == 0 else 0 if rank == num_ranks - 1 > 1 else t
        x = rng.standard_normal((t, shape.hidden)).astype(np.float32)
        x[:, 0], x[:, 1] = rank, np.arange(t)
        xs.append(x.astype(reference.bfloat16))
        idx = np.array([rng.permutation(num_experts)[:shape.num_topk] for _ in range(t)],
                       np.int64).reshape(t, shape.num_topk)
        idx[rng.random(idx.shape) < NO_EXPERT_SHARE] = -1
        topk_idxs.append(idx)
        weights.append(rng.uniform(-1, 1, size=(t, shape.num_topk)).astype(np.float32))
    return {"xs": xs, "topk_idxs": topk_idxs, "weights": weights}


def expert_fn(rank: int, recv_x: np.ndarray, recv_scales: np.ndarray | None) -> np.ndarray:
    """The experts of a rank: global expert e multiplies its (dequantized) rows by (e + 1) / 4."""
    num_local_experts, num_rows, hidden = recv_x.shape
    if recv_scales is None:
        values = recv_x.astype(np.float32)
    else:
        values = reference.dequantize_fp8(recv_x.reshape(-1, hidden), recv_scales.reshape(num_local_experts * num_rows, -1),
                                          use_ue8m0=False).reshape(recv_x.shape)
    factor = (rank * num_local_experts + np.arange(num_local_experts, dtype=np.float32) + 1) / 4
    return (values * factor[:, None, None]).astype(reference.bfloat16)


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bits of an array, so bf16/fp8 save to .npz and NaN and -0.0 compare exactly."""
    return np.ascontiguousarray(a).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


# ----------------------------------------------------------------------------- one step, per backend


def host_step(buffer, rank: int, inputs, shape: Shape, flags: dict, active: np.ndarray, timeout_us: int) -> dict:
    num_experts = shape.num_experts(buffer.num_ranks)
    x, topk_idx, weights = inputs["xs"][rank], inputs["topk_idxs"][rank], inputs["weights"][rank]
    recv_x, recv_count, handle, _, _ = buffer.dispatch(x, topk_idx, active, shape.num_max_tokens, num_experts,
                                                       timeout_us=timeout_us, **flags)
    q, scales = recv_x if flags["use_fp8"] else (recv_x, None)
    combined, _, _ = buffer.combine(expert_fn(rank, q, scales), topk_idx, weights, active, timeout_us, handle)
    saved = {"recv_x": bits(q), "recv_count": recv_count, "combined": bits(combined), "active_ranks": active.copy()}
    if scales is not None:
        saved["recv_scales"] = scales
    return saved


def cuda_step(buffer, rank: int, inputs, shape: Shape, flags: dict, active, timeout_us: int,
              mode: str = "sync") -> dict:
    """The same step with torch CUDA tensors, outputs poisoned, expert work on the host (exact).

    ``mode``: sync, async (``async_finish``: the work on the communication stream, waited for through
    its event) or hook (``return_recv_hook``: the send half now, the receive half in ``hook()``).
    """
    import torch

    modes = dict(async_finish=mode == "async", return_recv_hook=mode == "hook")

    num_ranks = buffer.num_ranks
    num_experts, num_local = shape.num_experts(num_ranks), shape.experts_per_rank
    rows, hidden = num_ranks * shape.num_max_tokens, shape.hidden
    x = torch.from_numpy(inputs["xs"][rank].view(np.uint16)).view(torch.bfloat16).cuda()
    topk_idx = torch.from_numpy(inputs["topk_idxs"][rank]).cuda()
    weights = torch.from_numpy(inputs["weights"][rank]).cuda()
    recv_count = torch.full((num_local,), -1, dtype=torch.int32, device="cuda")
    if flags["use_fp8"]:
        recv = (torch.full((num_local, rows, hidden), 0xFF, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn),
                torch.full((num_local, rows, hidden // 128), float("nan"), dtype=torch.float32, device="cuda"))
    else:
        recv = torch.full((num_local, rows, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    combined = torch.full((x.shape[0], hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    _, _, handle, event, hook = buffer.dispatch(x, topk_idx, active, shape.num_max_tokens, num_experts,
                                                timeout_us=timeout_us, out=(recv, recv_count), **flags, **modes)
    _finish(event, hook)
    if flags["use_fp8"]:
        q, scales = recv[0].view(torch.uint8).cpu().numpy().view(reference.float8_e4m3fn), recv[1].cpu().numpy()
    else:
        q, scales = recv.view(torch.uint16).cpu().numpy().view(reference.bfloat16), None
    expert_out = torch.from_numpy(expert_fn(rank, q, scales).view(np.uint16)).view(torch.bfloat16).cuda()
    torch.cuda.synchronize()
    _, event, hook = buffer.combine(expert_out, topk_idx, weights, active, timeout_us, handle, out=combined, **modes)
    _finish(event, hook)
    saved = {"recv_x": bits(q), "recv_count": recv_count.cpu().numpy(),
             "combined": combined.view(torch.uint16).cpu().numpy(), "active_ranks": active.cpu().numpy()}
    if scales is not None:
        saved["recv_scales"] = scales
    return saved


def _finish(event, hook) -> None:
    """Completes a call the way its mode says (hook(), or the caller's stream waiting for the event),
    then waits for the device, so the outputs are read after every kernel of the call."""
    import torch

    if hook is not None:
        hook()
    event.current_stream_wait()
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- the worker


def worker_main(argv: list[str]) -> None:
    """One rank. ``argv``: SCENARIO BACKEND OUT_DIR SEED SHAPE LONG_TIMEOUT_S MASK_TIMEOUT (see the module)."""
    import mooncake_ep as ep
    from _experiment import apply_experiment_macros

    apply_experiment_macros()
    scenario, backend, out_dir, seed = argv[0], argv[1], Path(argv[2]), int(argv[3])
    shape, long_timeout_s, mask_timeout = Shape.from_arg(argv[4]), float(argv[5]), float(argv[6])
    report: dict = {"scenario": scenario}
    rank = int(os.environ["RANK"])
    try:
        group = ep.init_group(timeout_s=long_timeout_s, rejoin=scenario == "replacement")
        num_ranks = group.world_size
        hidden = 2 * shape.hidden if scenario == "mismatch" else shape.hidden  # room for the wider one
        size = ep.Buffer.get_ep_buffer_size_hint(shape.num_max_tokens, hidden, num_ranks,
                                                 shape.num_experts(num_ranks))
        buffer = ep.Buffer(group, size, backend=backend)
        report["backend"] = buffer.backend
        report["transport"] = getattr(buffer._cuda, "transport", None)
        run = cuda_step if backend == "cuda" else host_step

        def mask():
            if backend == "cuda":
                import torch

                return torch.ones(num_ranks, dtype=torch.int32, device="cuda")
            return np.ones(num_ranks, np.int32)

        def save(label: str, step_seed: int, flags: dict, active, timeout_us: int, **mode) -> None:
            saved = run(buffer, rank, make_inputs(step_seed, num_ranks, shape), shape, flags, active, timeout_us,
                        **mode)
            np.savez(out_dir / f"rank{rank}_{label}.npz", **saved)

        long_us = min(int(long_timeout_s * 1e6), KERNEL_TIMEOUT_US)
        if scenario == "steps":
            for name, flags in PRECISIONS.items():
                save(name, seed, flags, mask(), long_us)
            if backend == "cuda":  # the other two launch modes (the halves apart; the communication stream), fp8
                for mode in GPU_MODES:
                    save(f"fp8-{mode}", seed, PRECISIONS["fp8"], mask(), long_us, mode=mode)
        elif scenario == "mismatch":  # the last rank dispatches twice the hidden size of the others
            wide = dataclasses.replace(shape, hidden=2 * shape.hidden)
            wrong = wide if rank == num_ranks - 1 else shape
            try:
                run(buffer, rank, make_inputs(seed, num_ranks, wrong), wrong, PRECISIONS["bf16"], mask(), long_us)
            except ValueError as exc:
                report["mismatch_error"] = str(exc)
            save("fp8", seed, PRECISIONS["fp8"], mask(), long_us)  # the rejected call left the buffer usable
        elif scenario in ("member", "victim"):
            save("step0", seed, PRECISIONS["fp8"], mask(), long_us)
            # Combine pulls expert outputs from the peers' workspaces: the victim dies only once
            # every rank is done with step 0, so step 1 is where its absence shows.
            group.barrier()
            if scenario == "victim":
                _write_report(out_dir, rank, scenario, report)
                os.kill(os.getpid(), signal.SIGKILL)  # dies as a crash would: no destroy, no goodbye
            survivors_mask = mask()
            if backend == "cuda":  # the kernels time out on the dead rank and mask it
                save("step1", seed + 1, PRECISIONS["fp8"], survivors_mask, int(mask_timeout * 1e6))
            else:  # the reference backend's collective times out, naming it
                group.timeout_s = mask_timeout
                try:
                    save("step1", seed + 1, PRECISIONS["fp8"], survivors_mask, long_us)
                except ep.GroupError as exc:
                    report["step1_error"] = str(exc)
                group.timeout_s = long_timeout_s
            report["replaced"] = buffer.update_ep_member()
            save("step2", seed + 2, PRECISIONS["bf16"], mask(), long_us)
        elif scenario == "replacement":
            report["epoch"] = group.membership_epoch
            save("step2", seed + 2, PRECISIONS["bf16"], mask(), long_us)
        buffer.destroy()
        group.close()
        report["ok"] = True
    except (ep.GroupError, ep.TransportError, ValueError, RuntimeError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    _write_report(out_dir, rank, scenario, report)


def _write_report(out_dir: Path, rank: int, scenario: str, report: dict) -> None:
    (out_dir / f"rank{rank}_{scenario}.json").write_text(json.dumps(report))


def read_report(out_dir: Path, rank: int, scenario: str) -> dict:
    path = out_dir / f"rank{rank}_{scenario}.json"
    return json.loads(path.read_text()) if path.exists() else {}


# ----------------------------------------------------------------------------- launching


class Launcher:
    """Starts ranks of one job (one store port) and waits for them."""

    def __init__(self, world_size: int, out_dir: Path, backend: str, seed: int, shape: Shape,
                 long_timeout_s: float, mask_timeout: float):
        self.world_size, self.port = world_size, free_port()
        self.common = [backend, str(out_dir), str(seed), shape.to_arg(), str(long_timeout_s), str(mask_timeout)]
        self.procs: list[tuple[int, str, subprocess.Popen]] = []

    def start(self, rank: int, scenario: str) -> subprocess.Popen:
        code = "import sys, _ep_processes as p; p.worker_main(sys.argv[1:])"
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
        env.update(RANK=str(rank), WORLD_SIZE=str(self.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                   PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")]))
        prefix = shlex.split(os.environ.get(RANK_PREFIX_VAR, ""))
        # A session of its own, so that a kill reaches the rank's python under a prefix's tool too.
        proc = subprocess.Popen([*prefix, sys.executable, "-c", code, scenario, *self.common], env=env, cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append((rank, scenario, proc))
        return proc

    def wait(self, limit_s: float) -> dict[tuple[int, str], int]:
        """Every process's exit code by (rank, scenario); kills what is still running at the limit."""
        deadline = time.monotonic() + limit_s
        codes = {}
        try:
            for rank, scenario, proc in self.procs:
                try:
                    output, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _kill_session(proc)
                    output, _ = proc.communicate()
                    raise AssertionError(f"rank {rank} ({scenario}) ran past {limit_s} s:\n{output}") from None
                codes[(rank, scenario)] = proc.returncode
                if proc.returncode not in (0, -signal.SIGKILL):
                    raise AssertionError(f"rank {rank} ({scenario}) exited {proc.returncode}:\n{output}")
        finally:
            self.kill()
        return codes

    def kill(self) -> None:
        for _, _, proc in self.procs:
            if proc.poll() is None:
                _kill_session(proc)
                proc.wait()


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a launched rank and whatever else runs in its session (its python under a prefix's tool)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # gone meanwhile
        pass


# ----------------------------------------------------------------------------- checking


def check_step(out_dir: Path, label: str, seed: int, shape: Shape, flags: dict, num_ranks: int,
               alive: list[bool]) -> None:
    """Compare every live rank's saved step with reference.py on the same inputs.

    Dispatch: recv_count exactly, the valid rows of recv_x (and scales) bit for bit, the mask after
    the call; combine bit for bit too, on either backend: the ranks' expert outputs are expert_fn's of
    rows equal to the reference's, and the kernel adds them as the reference does (fmaf in k order,
    one bf16 rounding; test_gpu_low_latency says why a tolerance is not enough).
    """
    inputs = make_inputs(seed, num_ranks, shape)
    num_experts = shape.num_experts(num_ranks)
    xs = [x if ok else None for x, ok in zip(inputs["xs"], alive)]
    topks = [t if ok else None for t, ok in zip(inputs["topk_idxs"], alive)]
    actives = [np.ones(num_ranks, np.int32)] * num_ranks
    results = [reference.dispatch(r, xs, topks, actives, shape.num_max_tokens, num_experts, **flags) if alive[r]
               else None for r in range(num_ranks)]
    expert_outs = [expert_fn(r, res.recv_x, res.recv_scales) if res is not None else None
                   for r, res in enumerate(results)]
    masks = [res.active_ranks if res is not None else np.ones(num_ranks, np.int32) for res in results]
    for rank in range(num_ranks):
        if not alive[rank]:
            continue
        got = np.load(out_dir / f"rank{rank}_{label}.npz")
        ref = results[rank]
        where = f"{label}, rank {rank} of {num_ranks}"
        np.testing.assert_array_equal(got["recv_count"], ref.recv_count, err_msg=f"{where}: recv_count")
        np.testing.assert_array_equal(got["active_ranks"], ref.active_ranks, err_msg=f"{where}: active_ranks")
        for e, count in enumerate(ref.recv_count):
            np.testing.assert_array_equal(got["recv_x"][e, :count], bits(ref.recv_x[e, :count]),
                                          err_msg=f"{where}: recv_x rows of local expert {e}")
            if ref.recv_scales is not None:
                np.testing.assert_array_equal(got["recv_scales"][e, :count], ref.recv_scales[e, :count],
                                              err_msg=f"{where}: recv_scales of local expert {e}")
        want, _ = reference.combine(rank, expert_outs, results, inputs["topk_idxs"][rank], inputs["weights"][rank],
                                    masks)
        np.testing.assert_array_equal(got["combined"], bits(want), err_msg=f"{where}: combined")


def run_replacement(tmp_path: Path, backend: str, shape: Shape, *, seed: int, long_timeout_s: float,
                    mask_timeout: float, limit_s: float, victim: int = 2, num_ranks: int = 3) -> dict[int, dict]:
    """The member/victim/replacement scenario; returns each final process's report by rank."""
    launcher = Launcher(num_ranks, tmp_path, backend, seed, shape, long_timeout_s, mask_timeout)
    try:
        for rank in range(num_ranks):
            launcher.start(rank, "victim" if rank == victim else "member")
        victim_proc = launcher.procs[victim][2]
        victim_proc.wait(timeout=limit_s)
        assert victim_proc.returncode == -signal.SIGKILL, read_report(tmp_path, victim, "victim")
        launcher.start(victim, "replacement")  # as an orchestrator would once it saw the death
        codes = launcher.wait(limit_s)
    finally:
        launcher.kill()
    assert codes[(victim, "victim")] == -signal.SIGKILL
    return {rank: read_report(tmp_path, rank, "replacement" if rank == victim else "member")
            for rank in range(num_ranks)}
