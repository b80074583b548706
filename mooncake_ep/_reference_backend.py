"""The CPU backend of :class:`mooncake_ep.Buffer`: the group exchanges inputs, reference.py computes.

Each call is one collective ``allgather_bytes`` of this rank's inputs; every rank then computes its
own outputs with :mod:`mooncake_ep.reference`. In hook mode the exchange is the send half and the
computation is the receive half, as on the GPU.

The exchange is a collective of the whole group: a rank that stops calling holds the others in it
until the group's ``timeout_s`` (then ``GroupError``). Masking a peer by ``timeout_us`` is the GPU
kernels'; here a peer masked in ``active_ranks`` contributes nothing, but must still take part.

So a rank never leaves a call for a reason its peers cannot see: a check of its arrays' values
(expert ids, combine's routing against its dispatch's; :func:`refusal_of`) that fails is its
verdict on the call, which it sends through the exchange in place of its arrays. Every rank then
raises at once and none counts the call (the group and the Buffers stay usable); checks of shapes,
dtypes and arguments still raise before the exchange, as every rank's call fields are compared in it.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable

import numpy as np

from mooncake_ep import reference
from mooncake_ep._group_common import GroupError, _PeerAbortedError
from mooncake_ep._handshake import RankMismatchError, by_rank


class ReferenceBackend:
    """Runs dispatch and combine on host arrays through the group.

    Args:
        group: any :class:`mooncake_ep.group.Group`.
    """

    def __init__(self, group):
        self.group = group

    def exchange(self, where: str, call: tuple[tuple[str, object], ...], *arrays: np.ndarray | None,
                 refusal: ValueError | None = None) -> list[tuple]:
        """Every rank's arrays, in rank order (the send half of a CPU call).

        ``call`` describes this rank's call as (field, value) pairs: which Buffer (its token), which
        call and its number, then the arguments every rank must share. The exchange pairs whatever
        the ranks send, so ranks in different calls (of two Buffers in different orders, or with
        different T) would mix their data or fail inside numpy; instead every rank raises the same
        ValueError, naming the first field of ``call`` on which the ranks disagree. A field
        ``"mesh position"`` (a JAX ``shard_map``'s, :data:`MESH_POSITION`) must instead equal each
        rank's own number, checked on every rank at once.

        ``refusal``: this rank's refusal of the call (:func:`refusal_of`), a check of its arrays'
        values or of its own state (a stale handle) that failed, which its peers cannot make. It is
        sent in place of ``arrays``, so that the peers leave the exchange with this rank instead of
        waiting for it until the group's timeout. A rank that refused raises its ``refusal`` (its call
        is refused whatever the others made); the others, once the call fields agree, a ValueError
        naming each refusing rank and its reason: the ranks made one call, which the group refused
        (RankMismatchError would say that their calls differ; it is theirs where the fields differ).

        Raises:
            GroupError: the group's collective failed (a peer did not come within its ``timeout_s``);
                the message names this call, which the group's own error cannot.
            RankMismatchError: the ranks are not in the same call (raised by every rank).
            ValueError: a peer's refusal (raised by every rank but the refusing ones).
            ValueError, RuntimeError: this rank's ``refusal``, as it was.
        """
        sent = (call, (), str(refusal)) if refusal is not None else (call, arrays, None)
        try:
            blobs = self.group.allgather_bytes(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
        except _PeerAbortedError:
            raise  # LocalGroup.spawn raises the failed peer's own error in its place
        except GroupError as exc:
            # A peer that never made this call (or refused it before its exchange: a shape or an
            # argument of its own) leaves the others here; the group's error names only its collective.
            raise GroupError(f"{_named(where, call)}: the exchange with the other ranks failed: {exc}") from exc
        if refusal is not None:
            raise refusal
        gathered = [_call_and_arrays(blob) for blob in blobs]
        calls = [dict(their_call) for their_call, _, _ in gathered]
        for field, _ in call:
            values = {rank: their_call.get(field) for rank, their_call in enumerate(calls)}
            if field == MESH_POSITION:
                if any(position != rank for rank, position in values.items()):
                    raise RankMismatchError(
                        f"{where}: the shard_map's mesh does not put each rank's device at the rank's position (mesh "
                        f"positions by rank: {by_rank(values)}), so the program's data (its experts, sharded by the "
                        f"mesh) would meet another rank's rows; give make_buffers the mesh's devices in its order, "
                        f"make_buffers(mesh.devices.flat, ...)")
                continue
            if len(set(values.values())) > 1:
                if field == "Buffer":  # tokens, named by first appearance
                    ordinals = {token: i for i, token in enumerate(dict.fromkeys(values.values()))}
                    values = {rank: f"Buffer #{ordinals[token]}" for rank, token in values.items()}
                raise RankMismatchError(f"{where}: the ranks are not in the same call: they disagree on {field} "
                                        f"({by_rank(values)}); every rank must make the same calls, with the same "
                                        f"arguments, on the same Buffers, in the same order")
        # After the call fields: a peer's refusal is of this call only where the ranks are in the same one.
        reasons = {rank: reason.removeprefix(f"{where}: ") for rank, (_, _, reason) in enumerate(gathered)
                   if reason is not None}
        if reasons:
            refused = "; ".join(f"rank {rank}: {reason}" for rank, reason in reasons.items())
            raise ValueError(f"{_named(where, call)}: rank{'s' if len(reasons) > 1 else ''} {', '.join(map(str, reasons))} of "
                             f"{len(gathered)} refused this call, so no rank made it (nothing received or counted; "
                             f"the group stays usable): {refused}")
        return [arrays for _, arrays, _ in gathered]

    def dispatch(self, gathered: list[tuple], num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
                 use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> reference.DispatchResult:
        xs, topk_idxs, active_ranks = zip(*gathered)
        return reference.dispatch(self.group.rank, xs, topk_idxs, active_ranks, num_max_dispatch_tokens_per_rank,
                                  num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)

    def dispatch_metadata(self, result: reference.DispatchResult) -> reference.DispatchResult:
        """The dispatch result without its payload: what peers need to answer a combine."""
        return dataclasses.replace(result, recv_x=np.empty(0), recv_scales=None)

    def combine(self, gathered: list[tuple], topk_idx: np.ndarray, topk_weights: np.ndarray, *,
                renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
        expert_outs, results, active_ranks = zip(*gathered)
        return reference.combine(self.group.rank, expert_outs, results, topk_idx, topk_weights, active_ranks,
                                 renormalize=renormalize)


def _named(where: str, call: tuple[tuple[str, object], ...]) -> str:
    """``where`` with the call's numbers (its dispatch's, in this Buffer's count), which the group's own
    errors cannot name; as it is for the JAX ops' calls, which have none."""
    numbers = ", ".join(f"{field} {value}" for field, value in call if "number" in field)
    return f"{where} ({numbers} of this Buffer)" if numbers else where


def refusal_of(check: Callable[..., None], *args) -> ValueError | RuntimeError | None:
    """The ValueError or RuntimeError ``check(*args)`` raises, or None: a check of a call's array values
    (or of this rank's state, as a stale handle) whose failure is sent through
    :meth:`ReferenceBackend.exchange` (its ``refusal``) rather than raised before it, where the peers
    would wait for this rank until the group's timeout."""
    try:
        check(*args)
    except (ValueError, RuntimeError) as exc:
        return exc
    return None


# The call field of a shard_map's mesh position, which must equal the rank (see ReferenceBackend.exchange).
MESH_POSITION = "mesh position"

# What a peer's blob says when it is not an exchange of data: the Buffer handshake's JSON, which
# the group's other collectives share the channel with (a rank building a Buffer, or in
# update_ep_member, while this one is in a call).
_NOT_A_DATA_EXCHANGE = (("call", "a Buffer construction or update_ep_member"),)


def _call_and_arrays(blob: bytes) -> tuple[tuple, tuple, str | None]:
    """A peer's blob as (its call fields, its arrays, its refusal's message or None)."""
    try:
        call, arrays, reason = pickle.loads(blob)
    except MemoryError:  # a call of ours that this host cannot hold: said as such, not as a mismatch
        raise
    except Exception:  # noqa: BLE001 - whatever the bytes were, they are not a call of ours
        return _NOT_A_DATA_EXCHANGE, (), None
    return call, arrays, reason

