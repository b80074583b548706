"""The CPU backend of :class:`mooncake_ep.Buffer`: the group exchanges inputs, reference.py computes.

Each call is one collective ``allgather_bytes`` of this rank's inputs; every rank then computes its
own outputs with :mod:`mooncake_ep.reference`. In hook mode the exchange is the send half and the
computation is the receive half, as on the GPU.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np

from mooncake_ep import reference


class ReferenceBackend:
    """Runs dispatch and combine on host arrays through the group.

    Args:
        group: any :class:`mooncake_ep.group.Group`.
    """

    def __init__(self, group):
        self.group = group

    def exchange(self, *arrays: np.ndarray | None) -> list[tuple]:
        """Every rank's arrays, in rank order (the send half of a CPU call)."""
        blobs = self.group.allgather_bytes(pickle.dumps(tuple(arrays), protocol=pickle.HIGHEST_PROTOCOL))
        return [pickle.loads(blob) for blob in blobs]

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
