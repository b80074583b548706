"""The ipc transport on the GPU: processes on one GPU, joined by init_group(), against reference.py.

Each rank is a process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them) that
builds its Buffer on cuda:0 through the TCP store, so its peers' workspaces are CUDA IPC mappings.
Without MPS the processes time-slice the GPU: the tests check correctness only, with generous
timeouts (a bug shows as a masked rank or a failed comparison, never a hang past the limit).
Outputs are poisoned, inputs encode their origin, and every element written is compared with
mooncake_ep.reference on the same inputs (see _ep_processes.py).
"""

from __future__ import annotations

import pytest

import _ep_processes as procs
from _ep_processes import PRECISIONS, Shape

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SMALL = Shape(num_max_tokens=6, hidden=256, num_topk=3, experts_per_rank=2)
WIDER = Shape(num_max_tokens=16, hidden=1152, num_topk=4, experts_per_rank=4)
# Seconds a process may take in all (start-up with torch and CUDA, kernel load, the steps).
PROCESS_LIMIT_S = 300.0
# Seconds the group's collectives wait (start-up of a replacement included).
LONG_TIMEOUT_S = 120.0
# Seconds the survivors' kernels wait for the killed rank before masking it.
MASK_TIMEOUT_S = 5.0


def launch(tmp_path, scenario: str, num_ranks: int, shape: Shape, seed: int) -> dict[int, dict]:
    launcher = procs.Launcher(num_ranks, tmp_path, "cuda", seed, shape, LONG_TIMEOUT_S, MASK_TIMEOUT_S)
    for rank in range(num_ranks):
        launcher.start(rank, scenario)
    launcher.wait(PROCESS_LIMIT_S)
    return {rank: procs.read_report(tmp_path, rank, scenario) for rank in range(num_ranks)}


def assert_on_the_gpu(reports: dict[int, dict]) -> None:
    for rank, report in reports.items():
        assert report.get("ok"), f"rank {rank}: {report}"
        assert (report["backend"], report["transport"]) == ("cuda", "ipc"), f"rank {rank}: {report}"


@pytest.mark.parametrize("num_ranks,shape", [(2, SMALL), (4, SMALL), (2, WIDER)],
                         ids=["R2-H256", "R4-H256", "R2-H1152"])
def test_processes_on_one_gpu_equal_reference(tmp_path, num_ranks, shape):
    seed = 7000 + 10 * num_ranks + shape.hidden
    assert_on_the_gpu(launch(tmp_path, "steps", num_ranks, shape, seed))
    for name, flags in PRECISIONS.items():
        procs.check_step(tmp_path, name, seed, shape, flags, num_ranks, [True] * num_ranks)
    for mode in procs.GPU_MODES:
        procs.check_step(tmp_path, f"fp8-{mode}", seed, shape, PRECISIONS["fp8"], num_ranks, [True] * num_ranks)


def test_mismatched_hidden_between_processes_raises_on_every_rank(tmp_path):
    seed = 7100
    reports = launch(tmp_path, "mismatch", 2, SMALL, seed)
    assert_on_the_gpu(reports)
    for report in reports.values():
        assert report["mismatch_error"] == (
            "dispatch: ranks disagree on hidden (rank 0: 256, rank 1: 512); every rank must dispatch the same T, "
            "hidden, num_experts and fp8 flags, or the kernels would read peers' workspaces at the wrong offsets, or "
            "their staged rows in the wrong form"), report
    procs.check_step(tmp_path, "fp8", seed, SMALL, PRECISIONS["fp8"], 2, [True, True])


def test_killed_process_is_masked_then_replaced_and_included(tmp_path):
    """Rank 2 of 3 is SIGKILLed after step 0; the survivors' kernels mask it in step 1; a replacement
    joins (init_group(rejoin=True), Buffer) while they call update_ep_member; step 2 includes it."""
    seed = 7200
    reports = procs.run_replacement(tmp_path, "cuda", SMALL, seed=seed, long_timeout_s=LONG_TIMEOUT_S,
                                    mask_timeout=MASK_TIMEOUT_S, limit_s=PROCESS_LIMIT_S)
    assert_on_the_gpu(reports)
    assert [reports[r]["replaced"] for r in (0, 1)] == [[2], [2]]
    procs.check_step(tmp_path, "step0", seed, SMALL, PRECISIONS["fp8"], 3, [True] * 3)
    # Step 1 as the reference sees it with rank 2 absent: no rows from it, its experts left out,
    # and active_ranks[2] = 0 on both survivors.
    procs.check_step(tmp_path, "step1", seed + 1, SMALL, PRECISIONS["fp8"], 3, [True, True, False])
    procs.check_step(tmp_path, "step2", seed + 2, SMALL, PRECISIONS["bf16"], 3, [True] * 3)
