"""Where each region of the symmetric workspace lies: the one place that does that arithmetic.

The kernels read the result as ``ep::Layout`` (``kernels_cu/layout.cuh``) from device memory;
:data:`LAYOUT_DTYPE` packs it field for field, and a test compiles the header with the host compiler
to check every offset. The regions are described in ``layout.cuh``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import numpy as np

from mooncake_ep._constants import FP8_BLOCK, MAX_RANKS, MAX_TOPK, WORKSPACE_ALIGNMENT

NUM_PARITIES = 2
# ep::State, field by field, each an array of NUM_PARITIES: u32 epochs, block finish counters, dispatch's
# staging count and the count its current call announced; then the sources dispatch found unstaged, a
# u64 bit word.
STATE_DTYPE = np.dtype(
    [(name, np.uint32, (NUM_PARITIES,))
     for name in ("dispatch_step", "combine_step", "dispatch_staged", "dispatch_recv_done", "combine_send_done",
                  "combine_recv_done", "dispatch_staged_target")]
    + [("dispatch_unstaged", np.uint64, (NUM_PARITIES,))]
)
STATE_FIELDS = STATE_DTYPE.names
STATE_BYTES = STATE_DTYPE.itemsize
FLAG_BYTES = 8
ROUTE_ENTRY_BYTES = 8
SOURCE_BYTES = 8  # one u64 address per parity
# Bytes of the device copy of a Layout, padded; the workspace header keeps one per configuration.
LAYOUT_SLOT_BYTES = 512

_PER_PARITY = ("send_x", "send_scales", "send_expert_offset", "send_list", "send_slot", "recv_range", "combine_x")

LAYOUT_DTYPE = np.dtype(
    [
        (name, np.int64)
        for name in (
            "num_ranks",
            "num_experts",
            "num_local_experts",
            "num_max_tokens",
            "hidden",
            "num_scales",
            "send_row_bytes",
            "state",
            "dispatch_flag",
            "dispatch_verdict",
            "combine_flag",
            "combine_verdict",
            "combine_ack",
            "combine_source",
            "route",
        )
    ]
    + [(name, np.int64, (NUM_PARITIES,)) for name in _PER_PARITY]
    + [("num_bytes", np.int64)]
)
assert LAYOUT_DTYPE.itemsize <= LAYOUT_SLOT_BYTES


def _align(offset: int) -> int:
    return -(-offset // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT


def _header_offsets() -> dict[str, int]:
    """Offsets of the configuration-independent front of the workspace: state, flags, route table."""
    offsets, cursor = {}, 0
    for name, num_bytes in (("state", STATE_BYTES),
                            ("dispatch_flag", NUM_PARITIES * MAX_RANKS * FLAG_BYTES),
                            ("dispatch_verdict", NUM_PARITIES * MAX_RANKS * FLAG_BYTES),
                            ("combine_flag", NUM_PARITIES * MAX_RANKS * FLAG_BYTES),
                            ("combine_verdict", NUM_PARITIES * MAX_RANKS * FLAG_BYTES),
                            ("combine_ack", NUM_PARITIES * MAX_RANKS * FLAG_BYTES),
                            ("combine_source", NUM_PARITIES * SOURCE_BYTES),
                            ("route", MAX_RANKS * ROUTE_ENTRY_BYTES)):
        offsets[name] = cursor
        cursor = _align(cursor + num_bytes)
    offsets["end"] = cursor
    return offsets


HEADER_OFFSETS = _header_offsets()
# Where the route table lies: the same for every configuration, so it is written once.
ROUTE_OFFSET = HEADER_OFFSETS["route"]


def state_offset(field: str, parity: int) -> int:
    """Byte offset of ``State.field[parity]`` in the workspace."""
    dtype, offset = STATE_DTYPE.fields[field][:2]
    return HEADER_OFFSETS["state"] + offset + parity * dtype.base.itemsize


def header_bytes() -> int:
    """Bytes of the configuration-independent front of the workspace."""
    return HEADER_OFFSETS["end"]


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of every region for one configuration.

    Attributes:
        num_ranks, num_experts, num_max_tokens, hidden: the configuration (R, E, T, H).
        offsets: region name → offset (int) or per-parity offsets (tuple), from the workspace base.
        num_bytes: the workspace size this configuration needs.
    """

    num_ranks: int
    num_experts: int
    num_max_tokens: int
    hidden: int
    offsets: dict
    num_bytes: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def send_row_bytes(self) -> int:
        return 2 * self.hidden

    def pack(self) -> bytes:
        """The ``ep::Layout`` struct, as the kernels read it."""
        record = np.zeros((), dtype=LAYOUT_DTYPE)
        record["num_ranks"] = self.num_ranks
        record["num_experts"] = self.num_experts
        record["num_local_experts"] = self.num_local_experts
        record["num_max_tokens"] = self.num_max_tokens
        record["hidden"] = self.hidden
        record["num_scales"] = self.hidden // FP8_BLOCK
        record["send_row_bytes"] = self.send_row_bytes
        for name, value in self.offsets.items():
            record[name] = value
        record["num_bytes"] = self.num_bytes
        return record.tobytes()


def compute_layout(num_ranks: int, num_experts: int, num_max_tokens: int, hidden: int,
                   num_workspace_bytes: int | None = None) -> WorkspaceLayout:
    """Lay out the workspace for R ranks, E experts, T tokens per rank and hidden H.

    Parity-major: after the header, the regions of parity 0, then those of parity 1. Given the
    Buffer's ``num_workspace_bytes``, parity p's regions start at the header plus p times half of
    what follows it, whatever the configuration: a call of one configuration and the next of
    another, which may still be read by peers, never share a byte. Regions of one parity are
    reused two calls later, when every peer is done with them, whatever the configurations.

    Args:
        num_workspace_bytes: the workspace size of the Buffer; None: parity 1 follows parity 0
            directly (the size :meth:`mooncake_ep.Buffer.get_ep_buffer_size_hint` reports).

    Raises:
        ValueError: the configuration does not fit in ``num_workspace_bytes``.
    """
    # Python ints, whatever integer type the caller's came as: numpy's int32 products wrap (a
    # negative size passed any check), and the cache would hand the wrapped layout to equal ints.
    return _compute_layout(operator.index(num_ranks), operator.index(num_experts), operator.index(num_max_tokens),
                           operator.index(hidden), None if num_workspace_bytes is None
                           else operator.index(num_workspace_bytes))


@functools.lru_cache(maxsize=256)
def _compute_layout(num_ranks: int, num_experts: int, num_max_tokens: int, hidden: int,
                    num_workspace_bytes: int | None) -> WorkspaceLayout:
    num_local_experts = num_experts // num_ranks
    offsets: dict = {name: value for name, value in HEADER_OFFSETS.items() if name != "end"}
    sizes = {
        "send_x": num_max_tokens * 2 * hidden,
        "send_scales": num_max_tokens * (hidden // FP8_BLOCK) * 4,
        "send_expert_offset": (num_experts + 1) * 4,
        "send_list": num_max_tokens * MAX_TOPK * 4,
        "send_slot": num_max_tokens * MAX_TOPK * 4,
        "recv_range": num_local_experts * num_ranks * 8,
        "combine_x": num_local_experts * num_ranks * num_max_tokens * hidden * 2,
    }
    relative, parity_bytes = {}, 0
    for name in _PER_PARITY:
        relative[name] = parity_bytes
        parity_bytes = _align(parity_bytes + sizes[name])
    num_bytes = header_bytes() + NUM_PARITIES * parity_bytes
    half = parity_bytes
    if num_workspace_bytes is not None:
        half = (num_workspace_bytes - header_bytes()) // NUM_PARITIES // WORKSPACE_ALIGNMENT * WORKSPACE_ALIGNMENT
        if parity_bytes > half:
            raise ValueError(f"compute_layout: (R={num_ranks}, E={num_experts}, T={num_max_tokens}, H={hidden}) needs "
                             f"{num_bytes} workspace bytes, the workspace has {num_workspace_bytes}")
    for name in _PER_PARITY:
        offsets[name] = tuple(header_bytes() + parity * half + relative[name] for parity in range(NUM_PARITIES))
    return WorkspaceLayout(num_ranks, num_experts, num_max_tokens, hidden, offsets, num_bytes)
