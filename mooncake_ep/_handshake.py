"""What the ranks of a Buffer check about each other before they share memory.

One allgather at construction and one at ``update_ep_member``: each rank sends a
:class:`RankConfig`, and every rank checks the same gathered list the same way, so a mismatch
raises on every rank with the same message (naming the ranks and their values) instead of
letting one rank go on into a collective, or a kernel, that its peers never reach.

The per-call configuration (T, hidden, num_experts and the fp8 flags) is only known at the first
dispatch of each configuration: :func:`check_same_configuration` is what ``CudaBackend.agree_on``
runs then, on multi-process groups.

Construction and ``update_ep_member`` exchange the same record (only ``phase`` differs), so a
process that replaces a dead rank builds its Buffer in the same collective in which the survivors
update theirs, and learns from them where they are (``num_dispatches``: the parity of the next call).
A building rank's record names the Buffers its process holds on the group (``held_tokens``): one
that holds the Buffer the others update is a live rank building a new Buffer instead of updating its
own, refused, where it had passed for a replacement and been connected in place of that Buffer.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Sequence


class RankMismatchError(ValueError):
    """The ranks are not making the same call, or not with the same configuration.

    Each rank's arguments may be fine on their own; together they do not fit (another Buffer size,
    fp8 flag, call, mooncake_ep version, ...). Raised on every rank at once, naming each rank's value.
    A ValueError, as every argument error of the library.
    """

CONSTRUCT = "construct"
UPDATE = "update"

# What every rank's dispatch must agree on, in this order: a dispatch's configuration. The first three
# place the workspace's regions; the flags say in which form the senders stage their rows.
CONFIGURATION_FIELDS = ("num_max_dispatch_tokens_per_rank", "hidden", "num_experts", "use_fp8", "round_scale",
                        "use_ue8m0")
_CONFIGURATION = struct.Struct("<qqq???")  # a configuration, in CONFIGURATION_FIELDS' order


@dataclasses.dataclass(frozen=True)
class RankConfig:
    """One rank's view of its Buffer, as the others see it.

    Attributes:
        version: ``mooncake_ep.__version__``.
        phase: :data:`CONSTRUCT` (``Buffer()``) or :data:`UPDATE` (``update_ep_member``).
        backend: ``"cuda"`` or ``"reference"``.
        num_ep_buffer_bytes: the workspace size (every rank's layout must be the same).
        num_dispatches: dispatches this buffer has made (0 when constructing).
        num_pending_hooks: receive hooks not called yet.
        device: the GPU, as the same string in every process (host and PCI bus id); "" on the CPU.
        device_name: the GPU in words, for messages.
        num_sms: blocks per launch: asked for (constructing; 0 = the default share of the device), or
            in use (updating).
        num_device_sms: SMs of the device (0 on the CPU).
        token: a random name of the Buffer; every rank adopts one (:func:`buffer_token`).
        held_tokens: constructing: the tokens of the live Buffers this process holds on the group
            (none for an in-process rank, see ``Buffer._held_tokens``); a replacement process holds
            none of the Buffers its peers update. Empty when updating.
    """

    version: str
    phase: str
    backend: str
    num_ep_buffer_bytes: int
    num_dispatches: int = 0
    num_pending_hooks: int = 0
    device: str = ""
    device_name: str = ""
    num_sms: int = 0
    num_device_sms: int = 0
    token: str = ""
    held_tokens: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "held_tokens", tuple(self.held_tokens))  # a JSON list, unpacked

    def pack(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def unpack(cls, blob: bytes) -> RankConfig:
        return cls(**json.loads(blob))


def exchange(group, mine: RankConfig, where: str) -> list[RankConfig]:
    """Every rank's config, in rank order, after checking that they fit together (collective).

    Raises:
        RankMismatchError: ranks differ in version, backend, num_ep_buffer_bytes or dispatch count, a
            rank is in another collective (a call of a Buffer: its blob is no RankConfig), or a rank
            builds a Buffer while the others update one that its own process holds.
        RuntimeError: some rank has receive hooks pending (update_ep_member).
        GroupError: from the group (a rank that does not come is named by it).
    """
    configs = [_unpack(blob, rank, where, mine) for rank, blob in enumerate(group.allgather_bytes(mine.pack()))]
    check(configs, where)
    return configs


def _unpack(blob: bytes, rank: int, where: str, mine: RankConfig) -> RankConfig:
    fields = None
    try:
        fields = json.loads(blob)
        return RankConfig(**fields)
    except (ValueError, TypeError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        # A config of another mooncake_ep (a field more or less) is named as such, not as another call.
        theirs = fields.get("version") if isinstance(fields, dict) else None
        if isinstance(theirs, str) and theirs != mine.version and "phase" in fields:
            raise RankMismatchError(f"{where}: ranks disagree on mooncake_ep version (rank {rank}: {theirs!r}, this "
                                    f"rank: {mine.version!r}); install the same mooncake_ep on every rank") from error
        raise RankMismatchError(f"{where}: the ranks are not in the same call: rank {rank} is not building a Buffer "
                                f"or in update_ep_member (a dispatch or combine?); every rank must make the same "
                                f"calls, on the same Buffers, in the same order") from error


def check(configs: Sequence[RankConfig], where: str) -> None:
    """Raise if the ranks' configs do not fit together (the same verdict on every rank)."""
    _same(where, configs, "version", "mooncake_ep version", lambda c: c.version,
          "install the same mooncake_ep on every rank")
    updating = [r for r, c in enumerate(configs) if c.phase == UPDATE]
    updated_tokens = {configs[r].token for r in updating}
    building = [r for r, c in enumerate(configs) if c.phase == CONSTRUCT and updated_tokens & set(c.held_tokens)]
    if building:  # before the sizes: a new Buffer of another size is this mistake too
        raise RankMismatchError(f"{where}: ranks {building} are building a new Buffer while ranks {updating} update "
                                f"theirs (update_ep_member), a Buffer that the processes of ranks {building} hold "
                                f"themselves (only a process that took over a dead rank, init_group(rejoin=True), "
                                f"builds its Buffers there): a rank whose process lives calls "
                                f"Buffer.update_ep_member() on each of its Buffers, in the order every rank does")
    _same(where, configs, "backend", "backend", lambda c: c.backend,
          "pass the same backend= everywhere (with 'auto' a rank that sees no GPU uses 'reference')")
    _same(where, configs, "num_ep_buffer_bytes", "num_ep_buffer_bytes", lambda c: c.num_ep_buffer_bytes,
          "size every rank's buffer with Buffer.get_ep_buffer_size_hint of the same configuration")
    running = [c for c in configs if c.phase == UPDATE]
    tokens = {r: c.token for r, c in enumerate(configs) if c.phase == UPDATE}
    if len(set(tokens.values())) > 1:  # with the same size, nothing else tells two Buffers of a group apart
        raise RankMismatchError(f"{where}: the ranks are updating different Buffers (their names: "
                                f"{by_rank(tokens)}); every rank must call update_ep_member on its rank of the same "
                                f"Buffer, in the same order")
    # On the reference backend a collective that timed out on some ranks and completed on others
    # counted its dispatch only where it completed: the update adopts the largest count
    # (running_dispatches), since no device holds a step counter that must agree with it.
    on_gpu = any(c.backend != "reference" for c in configs)
    if on_gpu and len({c.num_dispatches for c in running}) > 1:
        counts = by_rank({r: c.num_dispatches for r, c in enumerate(configs) if c.phase == UPDATE})
        raise RankMismatchError(f"{where}: ranks made different numbers of dispatches ({counts}); every rank must "
                                f"call dispatch and combine in the same order")
    pending = [r for r, c in enumerate(configs) if c.num_pending_hooks]
    if pending:
        raise RuntimeError(f"{where}: ranks {pending} have receive hooks pending; call them (on every rank) before "
                           f"update_ep_member")


def running_dispatches(configs: Sequence[RankConfig]) -> int:
    """How many dispatches the running ranks made (0 when every rank is constructing); the most,
    where they differ (the reference backend's ranks after a collective that failed on some).

    A replacement continues from there, so its next dispatch uses the same parity as theirs.
    """
    return max((c.num_dispatches for c in configs if c.phase == UPDATE), default=0)


def buffer_token(configs: Sequence[RankConfig]) -> str:
    """The Buffer's name on every rank: the survivors' (the updating ranks', equal: :func:`check`) where
    some update, so that a process replacing a dead rank, rank 0 included, adopts it; else rank 0's."""
    return next((c.token for c in configs if c.phase == UPDATE), configs[0].token)


def replaced_ranks(configs: Sequence[RankConfig]) -> list[int]:
    """Ranks that are constructing while the others update: processes that replaced a dead rank."""
    if all(c.phase == CONSTRUCT for c in configs):
        return []
    return [r for r, c in enumerate(configs) if c.phase == CONSTRUCT]


def num_sms_for(configs: Sequence[RankConfig], rank: int, where: str) -> int:
    """Blocks per launch of ``rank``, after checking that every GPU's ranks fit on it at once.

    A rank that asked for none gets the device's SMs shared evenly among the ranks on it; a
    replacement joining running ranks (an update) gets an even share of what the others use
    (the survivors' SMs in use, and those asked for) leave. Every rank checks every device, so an
    oversubscribed one raises everywhere: at an update, before any rank connects.

    Raises:
        ValueError: the ranks on one GPU need more SMs than it has (naming them and their values).
    """
    by_device: dict[str, list[int]] = {}
    for r, config in enumerate(configs):
        by_device.setdefault(config.device, []).append(r)

    def effective(r: int) -> int:
        config = configs[r]
        if config.num_sms:
            return config.num_sms
        ranks = by_device[config.device]
        if all(configs[q].phase == CONSTRUCT for q in ranks):
            return max(1, config.num_device_sms // len(ranks))
        # What the ranks with a num_sms (the survivors' in use, not theirs to give up) leave, shared.
        given = [configs[q].num_sms for q in ranks if configs[q].num_sms]
        return max(1, (config.num_device_sms - sum(given)) // (len(ranks) - len(given)))

    for ranks in by_device.values():
        first = configs[ranks[0]]
        total = sum(effective(r) for r in ranks)
        if total > first.num_device_sms:
            asked = by_rank({r: effective(r) for r in ranks})
            running = [r for r in ranks if configs[r].phase == UPDATE]
            if running:  # the survivors keep theirs: the replacements fit in what is left, or go elsewhere
                new = [r for r in ranks if configs[r].phase == CONSTRUCT]
                in_use = sum(configs[r].num_sms for r in running)
                share = (first.num_device_sms - in_use) // len(new)
                fix = (f"ranks {running} run with {in_use} of them: place ranks {new} on another GPU" +
                       (f", or give them num_sms <= {share} each" if share >= 1 else ""))
            else:
                fix = f"use num_sms <= {first.num_device_sms // len(ranks)}"
            raise ValueError(
                f"{where}: the {len(ranks)} ranks on {first.device_name} need num_sms {asked}, {total} SMs in all, "
                f"the device has {first.num_device_sms}: every rank's kernel must be resident at once, so {fix}")
    return effective(rank)


def check_same_configuration(group, configuration: tuple, where: str = "dispatch") -> None:
    """Raise on every rank unless every rank dispatches the same ``configuration`` (collective).

    Args:
        configuration: ``(num_max_dispatch_tokens_per_rank, hidden, num_experts, use_fp8, round_scale,
            use_ue8m0)`` (:data:`CONFIGURATION_FIELDS`). The workspace layout depends on the first
            three, and a kernel finds a region of a peer's workspace at its own offset; a receiver
            reads its peers' staged rows in the form its own flags say.

    Raises:
        RankMismatchError: the ranks differ (naming the fields, the ranks and their values).
    """
    blobs = group.allgather_bytes(_CONFIGURATION.pack(*configuration))
    elsewhere = [rank for rank, blob in enumerate(blobs) if len(blob) != _CONFIGURATION.size]
    if elsewhere:  # a rank building a Buffer, or in update_ep_member, sent its RankConfig
        raise RankMismatchError(f"{where}: the ranks are not in the same call: ranks {elsewhere} are not checking a "
                                f"dispatch's configuration (building a Buffer, or in update_ep_member?); every rank "
                                f"must make the same calls, on the same Buffers, in the same order")
    seen = [_CONFIGURATION.unpack(blob) for blob in blobs]
    if len(set(seen)) == 1:
        return
    differing = [i for i, _ in enumerate(CONFIGURATION_FIELDS) if len({theirs[i] for theirs in seen}) > 1]
    names = ", ".join(CONFIGURATION_FIELDS[i] for i in differing)
    values = {rank: theirs[differing[0]] if len(differing) == 1 else tuple(theirs[i] for i in differing)
              for rank, theirs in enumerate(seen)}
    raise RankMismatchError(
        f"{where}: ranks disagree on {names if len(differing) == 1 else f'({names})'} ({by_rank(values)}); every "
        f"rank must dispatch the same T, hidden, num_experts and fp8 flags, or the kernels would read peers' "
        f"workspaces at the wrong offsets, or their staged rows in the wrong form")


def _same(where: str, configs: Sequence[RankConfig], field: str, what: str, value: Callable[[RankConfig], object],
          fix: str) -> None:
    values = {r: value(c) for r, c in enumerate(configs)}
    if len(set(values.values())) > 1:
        raise RankMismatchError(f"{where}: ranks disagree on {what} ({by_rank(values)}); {fix}")


def by_rank(values: dict[int, object]) -> str:
    """``{0: a, 1: b, 2: a}`` as ``ranks [0, 2]: a, rank 1: b`` (first-seen order)."""
    groups: dict[object, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return ", ".join(f"ranks {ranks}: {value!r}" if len(ranks) > 1 else f"rank {ranks[0]}: {value!r}"
                     for value, ranks in groups.items())
