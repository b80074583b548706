"""A test helper shared by the in-process dispatch + combine tests (test_buffer_cpu.py, test_jax.py).

One step's global inputs (a :class:`Case`), what mooncake_ep.reference makes of them, and the raw bits
that results are compared by. Inputs encode their origin: channel 0 of rank s's token t holds s and
channel 1 holds t (exact in bf16), so a misrouted row names its source.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import ml_dtypes
import numpy as np

import mooncake_ep as ep
from mooncake_ep import reference

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass
class Case:
    """Global inputs of one dispatch + combine step (per-rank lists)."""

    num_ranks: int
    num_max_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    xs: list[np.ndarray]
    topk_idxs: list[np.ndarray]
    weights: list[np.ndarray]
    actives: list[np.ndarray]

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def size_hint(self) -> int:
        return ep.Buffer.get_ep_buffer_size_hint(self.num_max_tokens, self.hidden, self.num_ranks, self.num_experts)


def make_case(seed: int, num_ranks: int = 2, num_max_tokens: int = 4, hidden: int = 256, num_experts: int = 4,
              num_topk: int = 2, num_tokens: list[int] | None = None, actives: list[list[int]] | None = None,
              topk_dtype=np.int64, draw_rank0_count: bool = True) -> Case:
    """A random case; about a fifth of the topk entries are -1 (no expert).

    Without ``num_tokens`` rank 0 is full and the others draw 0..num_max_tokens tokens. Rank 0's count
    is drawn (and dropped) unless ``draw_rank0_count`` is false: test_buffer_cpu.py draws it and
    test_jax.py does not, and each file's seeds keep giving the inputs they always gave.
    """
    rng = np.random.default_rng(seed)
    if num_tokens is None:
        drawn = list(rng.integers(0, num_max_tokens + 1, size=num_ranks if draw_rank0_count else num_ranks - 1))
        num_tokens = [num_max_tokens] + drawn[len(drawn) - (num_ranks - 1):]
    xs, topk_idxs, weights = [], [], []
    for rank, t in enumerate(num_tokens):
        x = rng.standard_normal((t, hidden)).astype(np.float32)
        x[:, 0], x[:, 1] = rank, np.arange(t)
        xs.append(x.astype(BF16))
        idx = np.array([rng.permutation(num_experts)[:num_topk] for _ in range(t)], np.int64).reshape(t, num_topk)
        idx[rng.random(idx.shape) < 0.2] = -1
        topk_idxs.append(idx.astype(topk_dtype))
        weights.append(rng.uniform(-1, 1, size=(t, num_topk)).astype(np.float32))
    if actives is None:
        actives = [[1] * num_ranks for _ in range(num_ranks)]
    actives = [np.array(a, np.int32) for a in actives]
    return Case(num_ranks, num_max_tokens, hidden, num_experts, num_topk, xs, topk_idxs, weights, actives)


def reference_step(case: Case, flags: dict, experts: Callable[[int, reference.DispatchResult, dict], np.ndarray],
                   renormalize: bool = False) -> tuple[list[reference.DispatchResult], list[tuple]]:
    """mooncake_ep.reference's dispatch, ``experts(rank, dispatched, flags)``, then combine, on every rank.

    Returns each rank's dispatch result and its (combined, combine mask).
    """
    results = [reference.dispatch(r, case.xs, case.topk_idxs, case.actives, case.num_max_tokens, case.num_experts,
                                  **flags) for r in range(case.num_ranks)]
    outs = [experts(r, res, flags) for r, res in enumerate(results)]
    masks = [res.active_ranks for res in results]  # the buffer writes them back; combine gets them
    combined = [reference.combine(r, outs, results, case.topk_idxs[r], case.weights[r], masks, renormalize=renormalize)
                for r in range(case.num_ranks)]
    return results, combined


def bits(a) -> np.ndarray:
    """The raw bits of an array (numpy or anything np.asarray takes), so NaN poison and -0.0 compare exactly."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
