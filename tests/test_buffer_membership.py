"""Buffer over a real multi-process group: a killed process, its replacement, and bad configurations.

Processes joined by init_group() (the TCP store) on the reference backend, so this runs on any
machine; the same scenarios on the GPU kernels are in test_gpu_ipc.py. Every step is compared
with mooncake_ep.reference on the same inputs (see _ep_processes.py). No assertion is about
elapsed time; the process limit only turns a hang into a failure.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import _ep_processes as procs
from _ep_processes import PRECISIONS, Shape

SHAPE = Shape(num_max_tokens=6, hidden=256, num_topk=3, experts_per_rank=2)
# Safety net for a hung test process (a bug): the test fails instead of stalling CI.
PROCESS_LIMIT_S = 120.0
# How long collectives wait when every peer is expected (only bounds a failure).
LONG_TIMEOUT_S = 60.0
# How long the survivors' collective waits for the killed rank before naming it.
MASK_TIMEOUT_S = 2.0


def test_killed_process_is_named_replaced_and_included_in_the_next_step(tmp_path):
    reports = procs.run_replacement(tmp_path, "reference", SHAPE, seed=300, long_timeout_s=LONG_TIMEOUT_S,
                                    mask_timeout=MASK_TIMEOUT_S, limit_s=PROCESS_LIMIT_S)
    assert all(r.get("ok") for r in reports.values()), reports
    for rank in (0, 1):
        # The survivors' step-1 collective ended naming the dead rank (at once: its store connection
        # closed; the other survivor's slot may not have been there yet); update_ep_member took the
        # replacement in and says which rank changed hands.
        assert re.search(r"waiting for ranks \[(\d, )?2\] of 3 .*: ranks \[2\] left the group",
                         reports[rank]["step1_error"]), reports[rank]
        assert reports[rank]["replaced"] == [2]
    assert reports[2]["epoch"] == 1
    procs.check_step(tmp_path, "step0", 300, SHAPE, PRECISIONS["fp8"], 3, [True] * 3)
    procs.check_step(tmp_path, "step2", 302, SHAPE, PRECISIONS["bf16"], 3, [True] * 3)


WORKER = """
import json, sys
import mooncake_ep as ep
out = {}
try:
    group = ep.init_group(timeout_s=30.0)
    size = int(sys.argv[1 + group.rank])
    try:
        ep.Buffer(group, size, backend="reference")
        out["built"] = True
    except ValueError as exc:
        out["error"] = str(exc)
    # The rejected construction left the group usable: a correct Buffer works.
    buffer = ep.Buffer(group, int(sys.argv[1]), backend="reference")
    buffer.destroy()
    out["rebuilt"] = True
    group.close()
except ep.GroupError as exc:
    out["group_error"] = str(exc)
print(json.dumps(out))
"""


def run_workers(world_size: int, argv: list[str], port: int | None = None, ranks=None) -> dict[int, dict]:
    port = procs.free_port() if port is None else port
    base = {k: v for k, v in os.environ.items() if k not in procs.LAUNCH_VARS}
    running = {}
    for rank in range(world_size) if ranks is None else ranks:
        env = dict(base, RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=str(procs.REPO_ROOT))
        running[rank] = subprocess.Popen([sys.executable, "-c", WORKER, *argv], env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
    out = {}
    try:
        for rank, proc in running.items():
            stdout, stderr = proc.communicate(timeout=PROCESS_LIMIT_S)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}: {stderr}"
            out[rank] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
    return out


def test_mismatched_buffer_size_between_processes_raises_on_every_rank():
    size = 1 << 20
    out = run_workers(3, [str(size), str(size), str(size + 4096)])
    for rank in range(3):
        assert out[rank]["error"] == (f"Buffer: ranks disagree on num_ep_buffer_bytes (ranks [0, 1]: {size}, rank 2: "
                                      f"{size + 4096}); size every rank's buffer with Buffer.get_ep_buffer_size_hint "
                                      f"of the same configuration"), out
        assert out[rank]["rebuilt"], out


def test_port_already_taken_is_named_with_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_workers(2, ["4096", "4096"], port=port, ranks=[0])
    message = out[0]["group_error"]
    assert f"cannot listen on 127.0.0.1:{port}: the port is already in use" in message
    assert "set MASTER_PORT to a free port on every rank" in message
