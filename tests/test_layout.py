"""Tests of mooncake_ep.layout: the Python packing of ``ep::Layout`` against the C++ header, and the
workspace regions compute_layout lays out.

The header check compiles a small program with the host C++ compiler (layout.cuh and types.cuh
need only <cstdint> outside NVRTC) that prints offsetof() and sizeof() of every field of
``ep::Layout`` and sizeof(``ep::State``), and compares them with LAYOUT_DTYPE and STATE_BYTES.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mooncake_ep as ep
from mooncake_ep import layout
from mooncake_ep._constants import FP8_BLOCK, MAX_RANKS, MAX_TOPK, WORKSPACE_ALIGNMENT

KERNELS_CU = Path(__file__).resolve().parents[1] / "kernels_cu"
# Seconds the compiler may take for a 40-line program (only bounds a hang).
COMPILE_TIMEOUT_S = 120


def host_compiler() -> str | None:
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def header_layout(tmp_path_factory) -> dict[str, tuple[int, int]]:
    """``{field: (offsetof, sizeof)}`` of ep::Layout, plus ``sizeof(Layout)``, ``sizeof(State)`` and
    ``kNumParities`` under those names, as the host compiler sees layout.cuh."""
    compiler = host_compiler()
    if compiler is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++) on PATH: cannot check layout.cuh offsets")
    lines = [f'    print("{name}", offsetof(ep::Layout, {name}), sizeof(((ep::Layout*)nullptr)->{name}));'
             for name in layout.LAYOUT_DTYPE.names]
    lines += [f'    print("State.{name}", offsetof(ep::State, {name}), sizeof(((ep::State*)nullptr)->{name}));'
              for name in layout.STATE_FIELDS]
    source = "\n".join([
        "#include <cstddef>",
        "#include <cstdio>",
        '#include "layout.cuh"',
        "static void print(const char* name, size_t offset, size_t size) {",
        '    std::printf("%s %zu %zu\\n", name, offset, size);',
        "}",
        "int main() {",
        *lines,
        '    print("sizeof(Layout)", 0, sizeof(ep::Layout));',
        '    print("sizeof(State)", 0, sizeof(ep::State));',
        '    print("kNumParities", 0, ep::kNumParities);',
        "    return 0;",
        "}",
    ])
    build = tmp_path_factory.mktemp("layout")
    (build / "layout_offsets.cpp").write_text(source)
    binary = build / "layout_offsets"
    compiled = subprocess.run([compiler, "-std=c++17", "-I", str(KERNELS_CU), "-o", str(binary),
                               str(build / "layout_offsets.cpp")], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
    assert compiled.returncode == 0, (
        f"layout.cuh does not compile with the fields of LAYOUT_DTYPE (a field missing or renamed?):\n"
        f"{compiled.stderr}\n--- source ---\n{source}")
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=COMPILE_TIMEOUT_S)
    fields = {}
    for line in output.stdout.splitlines():
        name, offset, size = line.rsplit(" ", 2)
        fields[name] = (int(offset), int(size))
    return fields


def test_every_field_has_the_header_offset_and_size(header_layout):
    for name in layout.LAYOUT_DTYPE.names:
        dtype, offset = layout.LAYOUT_DTYPE.fields[name][:2]
        assert header_layout[name] == (offset, dtype.itemsize), (
            f"ep::Layout::{name} is at {header_layout[name][0]} ({header_layout[name][1]} bytes) in layout.cuh, "
            f"LAYOUT_DTYPE packs it at {offset} ({dtype.itemsize} bytes)")


def test_every_state_field_has_the_header_offset(header_layout):
    for name in layout.STATE_FIELDS:
        offset = layout.state_offset(name, 0) - layout.HEADER_OFFSETS["state"]
        size = layout.STATE_DTYPE.fields[name][0].itemsize
        assert header_layout[f"State.{name}"] == (offset, size), (
            f"ep::State::{name} is at {header_layout[f'State.{name}']} in layout.cuh, layout.py puts it at "
            f"{(offset, size)} (offset, bytes)")


def test_struct_sizes_match(header_layout):
    # Equal sizes with equal offsets of every Python field: the header has no field Python lacks.
    assert header_layout["sizeof(Layout)"][1] == layout.LAYOUT_DTYPE.itemsize
    assert header_layout["sizeof(State)"][1] == layout.STATE_BYTES
    assert header_layout["kNumParities"][1] == layout.NUM_PARITIES


def test_fields_are_int64_and_per_parity_arrays():
    for name in layout.LAYOUT_DTYPE.names:
        dtype = layout.LAYOUT_DTYPE.fields[name][0]
        assert dtype.base == np.int64, name
        assert dtype.shape in ((), (layout.NUM_PARITIES,)), name
    assert layout.LAYOUT_DTYPE.itemsize <= layout.LAYOUT_SLOT_BYTES


# --- compute_layout ---------------------------------------------------------------------------------

CONFIGS = [  # (num_ranks, num_experts, T, hidden)
    (1, 1, 1, 128),
    (2, 4, 4, 256),
    (3, 6, 5, 384),
    (4, 8, 16, 128),
    (8, 256, 128, 7168),
    (64, 1024, 3, 1152),
]


def region_sizes(num_ranks: int, num_experts: int, num_max_tokens: int, hidden: int) -> dict[str, int]:
    """Bytes of each region, as layout.cuh's comment describes them (independent of layout.py)."""
    num_local_experts = num_experts // num_ranks
    return {
        "state": layout.STATE_BYTES,
        "dispatch_flag": layout.NUM_PARITIES * MAX_RANKS * 8,
        "dispatch_verdict": layout.NUM_PARITIES * MAX_RANKS * 8,
        "combine_flag": layout.NUM_PARITIES * MAX_RANKS * 8,
        "combine_verdict": layout.NUM_PARITIES * MAX_RANKS * 8,
        "combine_ack": layout.NUM_PARITIES * MAX_RANKS * 8,
        "combine_source": layout.NUM_PARITIES * 8,
        "route": MAX_RANKS * 8,
        "send_x": num_max_tokens * 2 * hidden,
        "send_scales": num_max_tokens * hidden // FP8_BLOCK * 4,
        "send_expert_offset": (num_experts + 1) * 4,
        "send_list": num_max_tokens * MAX_TOPK * 4,
        "send_slot": num_max_tokens * MAX_TOPK * 4,
        "recv_range": num_local_experts * num_ranks * 8,
        "combine_x": num_local_experts * num_ranks * num_max_tokens * hidden * 2,
    }


def regions(workspace: layout.WorkspaceLayout) -> list[tuple[int, int, str]]:
    sizes = region_sizes(workspace.num_ranks, workspace.num_experts, workspace.num_max_tokens, workspace.hidden)
    out = []
    for name, offset in workspace.offsets.items():
        for parity, start in enumerate(offset if isinstance(offset, tuple) else (offset,)):
            out.append((start, sizes[name], f"{name}[{parity}]"))
    return sorted(out)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "R{}-E{}-T{}-H{}".format(*c))
def test_regions_are_aligned_disjoint_and_fit(config):
    workspace = layout.compute_layout(*config)
    assert set(workspace.offsets) == set(region_sizes(*config))
    for name in layout.LAYOUT_DTYPE.names:
        if layout.LAYOUT_DTYPE.fields[name][0].shape:
            assert len(workspace.offsets[name]) == layout.NUM_PARITIES, name
    spans = regions(workspace)
    for start, size, name in spans:
        assert start % WORKSPACE_ALIGNMENT == 0, f"{name} starts at {start}"
        assert size > 0, name
    for (start, size, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        assert start + size <= next_start, f"{name} [{start}, {start + size}) overlaps {next_name} at {next_start}"
    last_start, last_size, _ = spans[-1]
    assert last_start + last_size <= workspace.num_bytes
    assert workspace.num_bytes % WORKSPACE_ALIGNMENT == 0


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "R{}-E{}-T{}-H{}".format(*c))
def test_num_bytes_is_the_size_hint(config):
    num_ranks, num_experts, num_max_tokens, hidden = config
    workspace = layout.compute_layout(num_ranks, num_experts, num_max_tokens, hidden)
    assert workspace.num_bytes == ep.Buffer.get_ep_buffer_size_hint(num_max_tokens, hidden, num_ranks, num_experts)


def test_header_regions_do_not_depend_on_the_configuration():
    # layout.cuh: state, flags and route lie where every configuration finds them (epochs survive).
    fronts = {tuple(layout.compute_layout(*c).offsets[n] for n in ("state", "dispatch_flag", "dispatch_verdict",
                                                                 "combine_flag", "combine_verdict", "combine_ack",
                                                                 "combine_source",
                                                                 "route"))
              for c in CONFIGS}
    assert len(fronts) == 1
    for config in CONFIGS:
        workspace = layout.compute_layout(*config)
        first_configured = min(start for start, _, name in regions(workspace) if name.startswith("send_x"))
        assert first_configured == layout.header_bytes()


def test_pack_is_the_struct_the_kernels_read():
    workspace = layout.compute_layout(4, 8, 6, 384)
    packed = workspace.pack()
    assert len(packed) == layout.LAYOUT_DTYPE.itemsize
    record = np.frombuffer(packed, dtype=layout.LAYOUT_DTYPE)[0]
    assert (record["num_ranks"], record["num_experts"], record["num_local_experts"]) == (4, 8, 2)
    assert (record["num_max_tokens"], record["hidden"], record["num_scales"]) == (6, 384, 3)
    assert record["send_row_bytes"] == 2 * 384
    assert record["num_bytes"] == workspace.num_bytes
    for name, offset in workspace.offsets.items():
        np.testing.assert_array_equal(record[name], offset, err_msg=name)


# Configurations of one model a Buffer may serve one after another (R = 8, E = 256): decode,
# a prefill chunk, another hidden size.
SHARED_BUFFER = [(8, 256, 128, 7168), (8, 256, 16, 4096), (8, 256, 300, 2048)]


def test_consecutive_configurations_never_share_bytes_between_parities():
    """A call of one configuration and the next, of another and the other parity, are disjoint.

    The previous call may still be read by peers when the next one stages its tokens: with a
    layout per configuration packed from the header, (T = 16, H = 4096)'s parity 1 would lie in
    the middle of (T = 128, H = 7168)'s parity 0.
    """
    num_bytes = max(ep.Buffer.get_ep_buffer_size_hint(t, h, r, e) for r, e, t, h in SHARED_BUFFER) + 4096
    layouts = [layout.compute_layout(*config, num_workspace_bytes=num_bytes) for config in SHARED_BUFFER]
    for workspace in layouts:
        spans = regions(workspace)
        assert spans[-1][0] + spans[-1][1] <= num_bytes
    for first in layouts:
        for second in layouts:
            for start, size, name in regions(first):
                if not name.endswith("[0]") or name.split("[")[0] not in layout._PER_PARITY:
                    continue
                for other_start, other_size, other_name in regions(second):
                    if other_name.endswith("[1]") and other_name.split("[")[0] in layout._PER_PARITY:
                        assert start + size <= other_start or other_start + other_size <= start, \
                            f"{first.hidden}'s {name} overlaps {second.hidden}'s {other_name}"


def test_a_configuration_too_large_for_the_workspace_is_refused():
    needed = ep.Buffer.get_ep_buffer_size_hint(128, 7168, 8, 256)
    layout.compute_layout(8, 256, 128, 7168, num_workspace_bytes=needed)  # exactly the hint fits
    with pytest.raises(ValueError, match="needs .* workspace bytes"):
        layout.compute_layout(8, 256, 128, 7168, num_workspace_bytes=needed - 1)


@pytest.mark.parametrize("integer", [np.int32, np.int64, np.uint32], ids=lambda t: t.__name__)
def test_numpy_integer_sizes_lay_out_as_python_ints(integer):
    """numpy int32 products wrap: T = np.int32(8192) made 'needed' negative, a 1 MiB buffer passed
    dispatch's size check for 7.5 GB of regions (kernels writing far outside the workspace), and
    the cache then served the wrapped layout to the same sizes given as Python ints."""
    R, E, T, H = 1, 32, 8192, 7168
    want = layout.compute_layout(R, E, T, H)
    assert want.num_bytes > 2**32
    got = layout.compute_layout(integer(R), integer(E), integer(T), integer(H))
    assert got == want and type(got.num_bytes) is int
    assert layout.compute_layout(R, E, T, H) == want
    assert ep.Buffer.get_ep_buffer_size_hint(integer(T), integer(H), integer(R), integer(E)) == want.num_bytes

    def rank_fn(group):
        buffer = ep.Buffer(group, 1 << 20, backend="reference")
        x = np.zeros((2, H), np.float32).astype(ep.reference.bfloat16)
        with pytest.raises(ValueError, match=rf"the buffer has 1048576 bytes, this configuration \(T={T}, "
                                             rf"hidden={H}, num_experts={E}, num_ranks=1\) needs {want.num_bytes}"):
            buffer.dispatch(x, np.array([[0], [1]]), np.ones(1, np.int32), integer(T), integer(E), use_fp8=False)
    ep.LocalGroup(1).spawn(rank_fn)
