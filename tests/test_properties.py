"""Property tests of mooncake_ep.Buffer on the reference backend, over random configurations.

Each example runs in-process ranks (LocalGroup): dispatch, identity experts (recv_x fed back, fp8
dequantized first), combine. Properties:

- combine of identity experts is sum_k w_k * x over the token's live experts (bf16 tolerance);
- recv_count of each local expert is the histogram of topk_idx over the ranks that deliver to it;
- the masks come back unchanged when both sides of every pair agree;
- two runs of the same inputs are bitwise equal.

Shapes: R in {1, 2, 4}, hidden a multiple of 128 up to 512, top-k 1..min(8, E), E a multiple of R,
t <= T tokens per rank (0 included), -1 entries, uniform or skewed routing, random symmetric masks
of inactive pairs, bf16 and the three fp8 modes, with and without renormalize.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

import mooncake_ep as ep
from mooncake_ep import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
MODES = {
    "bf16": dict(use_fp8=False),
    "fp8": dict(use_fp8=True),
    "fp8-round": dict(use_fp8=True, round_scale=True),
    "fp8-ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True),
}
# bf16 keeps 8 significant bits: rounding the fp32 sum once errs by at most 2^-9 of the sum of
# |w_k * x|; 2^-8 leaves room for the fp32 accumulation (K <= 8 roundings of 2^-24).
BF16_TOLERANCE = 2.0**-8
# e4m3 keeps 3 mantissa bits: a dequantized value errs by at most 2^-4 of its block's amax; 2^-3
# also covers rounding the dequantized value to bf16 for the expert.
FP8_TOLERANCE = 2.0**-3
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)


@dataclasses.dataclass
class Example:
    num_ranks: int
    num_experts: int
    num_topk: int
    hidden: int
    num_max_tokens: int
    mode: str
    renormalize: bool
    xs: list[np.ndarray]
    topk_idxs: list[np.ndarray]
    weights: list[np.ndarray]
    mask: np.ndarray  # [R, R] symmetric, ones on the diagonal: mask[s][d] = 1 if s and d see each other

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def flags(self) -> dict:
        return MODES[self.mode]


@st.composite
def examples(draw) -> Example:
    num_ranks = draw(st.sampled_from([1, 2, 4]))
    num_experts = num_ranks * draw(st.integers(1, 4))
    num_topk = draw(st.integers(1, min(8, num_experts)))
    hidden = 128 * draw(st.integers(1, 4))
    num_max_tokens = draw(st.integers(1, 8))
    num_tokens = draw(st.lists(st.integers(0, num_max_tokens), min_size=num_ranks, max_size=num_ranks))
    # Routing nothing at all is one explicit example (NOTHING_ROUTED): drawn, it had taken 10 of 25.
    p_none = draw(st.sampled_from([0.0, 0.25]))
    skewed = draw(st.booleans())
    mode = draw(st.sampled_from(sorted(MODES)))
    renormalize = draw(st.booleans())
    pairs = [(s, d) for s in range(num_ranks) for d in range(s + 1, num_ranks)]
    cut = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_example(num_ranks, num_experts, num_topk, hidden, num_max_tokens, num_tokens, p_none, skewed, mode,
                        renormalize, cut, seed)


def make_example(num_ranks: int, num_experts: int, num_topk: int, hidden: int, num_max_tokens: int,
                 num_tokens: list[int], p_none: float, skewed: bool, mode: str, renormalize: bool, cut: list[bool],
                 seed: int) -> Example:
    pairs = [(s, d) for s in range(num_ranks) for d in range(s + 1, num_ranks)]
    rng = np.random.default_rng(seed)
    # Skewed routing: expert e is chosen with probability proportional to 1 / (e + 1) (Zipf-like).
    p = 1.0 / np.arange(1, num_experts + 1) if skewed else np.ones(num_experts)
    p /= p.sum()
    xs, topk_idxs, weights = [], [], []
    for t in num_tokens:
        # Magnitudes spread over a few decades per token, so fp8 blocks see different scales.
        x = rng.standard_normal((t, hidden)) * 10.0 ** rng.uniform(-2, 2, size=(t, 1))
        xs.append(x.astype(BF16))
        idx = np.array([rng.choice(num_experts, num_topk, replace=False, p=p) for _ in range(t)], np.int64)
        idx = idx.reshape(t, num_topk)
        idx[rng.random(idx.shape) < p_none] = -1
        topk_idxs.append(idx)
        # Positive weights with renormalize (a live sum near 0 would make the rescaling meaningless).
        low = 0.05 if renormalize else -1.0
        weights.append(rng.uniform(low, 1.0, size=(t, num_topk)).astype(np.float32))
    mask = np.ones((num_ranks, num_ranks), np.int32)
    for (s, d), is_cut in zip(pairs, cut):
        if is_cut:
            mask[s, d] = mask[d, s] = 0
    return Example(num_ranks, num_experts, num_topk, hidden, num_max_tokens, mode, renormalize, xs, topk_idxs,
                   weights, mask)


# Every entry -1 on every rank, fp8 with renormalize and a cut pair: no rows anywhere, and combine's
# sums over no live expert (renormalize's divisor 0) must still come back as zeros.
NOTHING_ROUTED = make_example(num_ranks=4, num_experts=8, num_topk=2, hidden=256, num_max_tokens=4,
                              num_tokens=[4, 0, 3, 4], p_none=1.0, skewed=False, mode="fp8", renormalize=True,
                              cut=[True, False, False, False, False, False], seed=5)


@dataclasses.dataclass
class RankResult:
    recv_rows: list[np.ndarray]  # per local expert, the valid rows of recv_x (raw bits)
    recv_scales: list[np.ndarray] | None
    recv_count: np.ndarray
    combined: np.ndarray
    mask_after_dispatch: np.ndarray
    mask_after_combine: np.ndarray


def identity_experts(recv_x, flags: dict) -> np.ndarray:
    """The expert outputs of identity experts: recv_x itself, or dequantized fp8 rounded to bf16."""
    if not flags["use_fp8"]:
        return recv_x.copy()
    q, scales = recv_x
    shape = q.shape
    deq = reference.dequantize_fp8(q.reshape(-1, shape[2]), scales.reshape(shape[0] * shape[1], -1),
                                   use_ue8m0=flags.get("use_ue8m0", False))
    return deq.reshape(shape).astype(BF16)


def rank_step(group, example: Example) -> RankResult:
    rank, flags = group.rank, example.flags
    size = ep.Buffer.get_ep_buffer_size_hint(example.num_max_tokens, example.hidden, example.num_ranks,
                                             example.num_experts)
    buf = ep.Buffer(group, size, backend="reference")
    active = example.mask[rank].copy()
    recv_x, recv_count, handle, _, _ = buf.dispatch(example.xs[rank], example.topk_idxs[rank], active,
                                                    example.num_max_tokens, example.num_experts, **flags)
    mask_after_dispatch = active.copy()
    combined, _, _ = buf.combine(identity_experts(recv_x, flags), example.topk_idxs[rank], example.weights[rank],
                                 active, -1, handle, renormalize=example.renormalize)
    q, scales = recv_x if flags["use_fp8"] else (recv_x, None)
    counts = recv_count.copy()
    rows = [q[e, :counts[e]].view(np.uint8).copy() for e in range(len(counts))]
    scale_rows = None if scales is None else [scales[e, :counts[e]].copy() for e in range(len(counts))]
    return RankResult(rows, scale_rows, counts, combined.copy(), mask_after_dispatch, active.copy())


def run(example: Example) -> list[RankResult]:
    return ep.LocalGroup(example.num_ranks, timeout_s=30.0).spawn(rank_step, example)


def owner(expert: np.ndarray, example: Example) -> np.ndarray:
    return expert // example.num_local_experts


def fed_back(x: np.ndarray, flags: dict) -> np.ndarray:
    """What the identity expert returns for tokens x (fp32): x itself, or its fp8 round trip in bf16."""
    if not flags["use_fp8"]:
        return x.astype(np.float32)
    q, scales = reference.quantize_fp8(x, round_scale=flags.get("round_scale", False),
                                       use_ue8m0=flags.get("use_ue8m0", False))
    return reference.dequantize_fp8(q, scales, use_ue8m0=flags.get("use_ue8m0", False)).astype(BF16).astype(np.float32)


def effective_weights(example: Example, rank: int) -> np.ndarray:
    """``[t, K]`` float64 weights of the live experts of rank's tokens (renormalized when asked), 0 elsewhere."""
    idx, w = example.topk_idxs[rank], example.weights[rank].astype(np.float64)
    valid = idx >= 0
    live = valid & (example.mask[rank][np.where(valid, owner(idx, example), 0)] == 1)
    effective = np.where(live, w, 0.0)
    if example.renormalize:
        total = np.where(valid, w, 0).sum(axis=1)
        kept = effective.sum(axis=1)
        effective *= np.where(kept != 0, total / np.where(kept != 0, kept, 1), 0)[:, None]
    return effective


def check_combine(example: Example, rank: int, combined: np.ndarray) -> None:
    assert combined.dtype == BF16 and combined.shape == example.xs[rank].shape
    w = effective_weights(example, rank)
    x = example.xs[rank]
    x_fed = fed_back(x, example.flags).astype(np.float64)
    got = combined.astype(np.float64)
    dense = w.sum(axis=1)[:, None] * x_fed
    bound = BF16_TOLERANCE * np.abs(w).sum(axis=1)[:, None] * np.abs(x_fed)
    assert np.all(np.abs(got - dense) <= bound), f"rank {rank}: max error {np.abs(got - dense).max()}"
    if example.flags["use_fp8"]:
        # Against the original tokens: the fp8 error of the expert inputs, bounded by the block amax.
        x64 = x.astype(np.float64)
        amax = np.abs(x64.reshape(len(x), example.hidden // 128, 128)).max(axis=2).repeat(128, axis=1)
        bound = np.abs(w).sum(axis=1)[:, None] * (BF16_TOLERANCE * np.abs(x_fed) + FP8_TOLERANCE * amax)
        assert np.all(np.abs(got - w.sum(axis=1)[:, None] * x64) <= bound)


@PROPERTY_SETTINGS
@given(examples())
@example(NOTHING_ROUTED)
def test_identity_experts_combine_to_weighted_sum_and_counts_are_histograms(example):
    results = run(example)
    for rank, result in enumerate(results):
        # Counts: copies of this rank's experts from every rank that delivers to it.
        histogram = np.zeros(example.num_experts, np.int64)
        for src, idx in enumerate(example.topk_idxs):
            if example.mask[src, rank]:
                histogram += np.bincount(idx[idx >= 0], minlength=example.num_experts)
        own = slice(rank * example.num_local_experts, (rank + 1) * example.num_local_experts)
        np.testing.assert_array_equal(result.recv_count, histogram[own])
        # Both sides agree on every cut pair, so nobody times out and the masks come back as given.
        np.testing.assert_array_equal(result.mask_after_dispatch, example.mask[rank])
        np.testing.assert_array_equal(result.mask_after_combine, example.mask[rank])
        check_combine(example, rank, result.combined)


@PROPERTY_SETTINGS
@given(examples())
def test_two_runs_are_bitwise_equal(example):
    first, second = run(example), run(example)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.recv_count, b.recv_count)
        for rows_a, rows_b in zip(a.recv_rows, b.recv_rows):
            np.testing.assert_array_equal(rows_a, rows_b)
        if a.recv_scales is not None:
            for scales_a, scales_b in zip(a.recv_scales, b.recv_scales):
                np.testing.assert_array_equal(scales_a.view(np.uint8), scales_b.view(np.uint8))
        np.testing.assert_array_equal(a.combined.view(np.uint16), b.combined.view(np.uint16))
