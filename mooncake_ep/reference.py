"""The semantics of low-latency dispatch and combine, written plainly in numpy.

This module is two things: the CPU backend of :class:`mooncake_ep.Buffer` (arrays that live in host
memory run here), and the oracle every GPU test compares against. It shares no code with the kernels
or the buffer: an oracle that shared code with its subject would share its bugs.

The functions take the whole group's view (every rank's inputs) and return one rank's outputs, so a
test can compute what each rank must see without running any communication.

Conventions (R ranks, E experts, E_l = E / R local experts per rank, T =
num_max_dispatch_tokens_per_rank, H hidden, K top-k):

- Expert ``e`` lives on rank ``e // E_l`` as its local expert ``e % E_l``.
- Inside a local expert, received rows are ordered by source rank, then source token, then top-k
  slot. Rows past ``recv_count[e_l]`` are undefined (this module fills them with zeros).
- A rank ``s`` delivers rows to rank ``d`` only when both see each other as active: the sender skips
  ranks it has masked, and the receiver, waiting for a rank that sends nothing, times out and masks it.
  A rank that never ran (``None`` inputs) sends nothing and is masked by every receiver that expected it.
- FP8: e4m3fn, one fp32 scale per token per 128 channels, ``scale = max(amax, 1e-4) * fp32(1/448)``;
  ``round_scale`` rounds the scale up to a power of two; ``use_ue8m0`` stores only its 8-bit biased
  exponent, four to an int32 (byte ``j % 4`` of word ``j // 4`` belongs to channel block ``j``).
  Values are quantised as ``x * (448 / max(amax, 1e-4))``, or ``x * (1 / scale)`` for a rounded
  scale (DeepEP's multiply form), saturated to the finite e4m3 range.
- Combine accumulates ``w * y`` in fp32 over k in order, each step one fused multiply-add, and rounds
  the sum to bf16 once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from mooncake_ep._constants import FP8_AMAX_FLOOR, FP8_BLOCK, FP8_E4M3_MAX, UE8M0_PER_INT32

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)

_FP32_EXPONENT_MASK = np.uint32(0x7F800000)
_FP32_MANTISSA_MASK = np.uint32(0x007FFFFF)
_FP32_MANTISSA_BITS = 23


def num_scale_columns(hidden: int, use_ue8m0: bool) -> int:
    """Columns of the scale tensor for one token: H/128 fp32, or ceil(H/128/4) packed int32."""
    num_blocks = hidden // FP8_BLOCK
    return -(-num_blocks // UE8M0_PER_INT32) if use_ue8m0 else num_blocks


_E4M3_CANONICAL_NAN = 0x7F


def quantize_fp8(x: np.ndarray, *, round_scale: bool, use_ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """Quantize bf16 rows to e4m3fn with one scale per 128 channels.

    Args:
        x: ``[num_tokens, hidden]`` bf16 (or anything castable to fp32 exactly).
        round_scale: round each scale up to a power of two.
        use_ue8m0: return the scales as packed 8-bit exponents (requires ``round_scale``).

    Returns:
        ``(q, scales)``: q ``[num_tokens, hidden]`` float8_e4m3fn; scales ``[num_tokens, hidden / 128]``
        fp32, or ``[num_tokens, ceil(hidden / 512)]`` int32 with ``use_ue8m0``.
    """
    if use_ue8m0 and not round_scale:  # the exponent byte of a scale that is no power of two is not that scale
        raise ValueError("quantize_fp8: use_ue8m0 requires round_scale")
    num_tokens, hidden = x.shape
    blocks = x.astype(np.float32).reshape(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    # fmax, not max: a NaN channel is left out of its block's amax (the kernels' fmaxf does the
    # same), so it stays NaN alone instead of turning every value of the block into NaN.
    amax = np.maximum(np.fmax.reduce(np.abs(blocks), axis=2, initial=np.float32(0)), np.float32(FP8_AMAX_FLOOR))
    # DeepEP's recipe: the stored scale is amax times the fp32 reciprocal of 448 (one rounding of
    # 1/448, one of the product); values are multiplied by 448 / amax (one division per block), or
    # by 1 / scale, exact, when the scale is rounded to a power of two. Each step is one correctly
    # rounded fp32 operation, as in the kernels (which use the _rn intrinsics: no FMA contracts them).
    scale = (amax * (np.float32(1) / np.float32(FP8_E4M3_MAX))).astype(np.float32)
    if round_scale:
        scale = _round_up_to_power_of_two(scale)
        multiplier = (np.float32(1) / scale).astype(np.float32)
    else:
        multiplier = (np.float32(FP8_E4M3_MAX) / amax).astype(np.float32)
    # The product cannot exceed 448 by more than its rounding, which the cast rounds back to 448
    # (the kernels saturate).
    with np.errstate(invalid="ignore"):  # inf * 0 in a block holding inf: NaN, as in the kernels
        q = (blocks * multiplier[:, :, None]).astype(float8_e4m3fn).reshape(num_tokens, hidden)
    # Every NaN as the kernels' saturating conversion writes it (cvt.rn.satfinite.e4m3x2.f32): the one
    # canonical 0x7F, whatever the input NaN's sign (the cast above keeps the sign: 0xFF for -NaN).
    q.view(np.uint8)[np.isnan(q)] = _E4M3_CANONICAL_NAN
    if not use_ue8m0:
        return q, scale
    exponent_bytes = ((scale.view(np.uint32) >> _FP32_MANTISSA_BITS) & np.uint32(0xFF)).astype(np.uint8)
    num_words = num_scale_columns(hidden, True)
    padded = np.zeros((num_tokens, num_words * UE8M0_PER_INT32), dtype=np.uint8)
    padded[:, : exponent_bytes.shape[1]] = exponent_bytes
    return q, padded.view("<i4").astype(np.int32)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray, *, use_ue8m0: bool) -> np.ndarray:
    """Inverse of :func:`quantize_fp8` (up to fp8 rounding): ``[n, H]`` e4m3fn → ``[n, H]`` fp32."""
    num_tokens, hidden = q.shape
    num_blocks = hidden // FP8_BLOCK
    if use_ue8m0:
        exponent_bytes = np.ascontiguousarray(scales.astype(np.int32)).view(np.uint8)[:, :num_blocks]
        scale = (exponent_bytes.astype(np.uint32) << _FP32_MANTISSA_BITS).view(np.float32)
    else:
        scale = scales.astype(np.float32)
    blocks = q.astype(np.float32).reshape(num_tokens, num_blocks, FP8_BLOCK)
    return (blocks * scale[:, :, None]).reshape(num_tokens, hidden)


def _round_up_to_power_of_two(scale: np.ndarray) -> np.ndarray:
    bits = scale.view(np.uint32)
    exponent = (bits & _FP32_EXPONENT_MASK) >> _FP32_MANTISSA_BITS
    exponent = exponent + ((bits & _FP32_MANTISSA_MASK) != 0).astype(np.uint32)
    return (exponent << _FP32_MANTISSA_BITS).view(np.float32)


def expert_slots(topk_idx: np.ndarray, num_experts: int) -> np.ndarray:
    """Position of each (token, k) copy among this rank's copies to the same expert.

    Args:
        topk_idx: ``[num_tokens, num_topk]`` integer expert ids, ``-1`` = none.
        num_experts: E.

    Returns:
        ``[num_tokens, num_topk]`` int64: for a valid entry, how many entries with the same expert
        come before it in (token, k) order; ``-1`` where the entry names no expert (-1, or an id
        outside [0, E), which the kernels read as -1).
    """
    flat = topk_idx.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")  # each expert's copies together, in (token, k) order
    ordered = flat[order]
    slots = np.empty(flat.shape, dtype=np.int64)
    slots[order] = np.arange(flat.size) - np.searchsorted(ordered, ordered, side="left")
    slots[(flat < 0) | (flat >= num_experts)] = -1
    return slots.reshape(topk_idx.shape)


@dataclasses.dataclass
class DispatchResult:
    """What one rank receives from a low-latency dispatch.

    Attributes:
        recv_x: ``[E_l, R * T, H]`` bf16, or float8_e4m3fn with ``use_fp8``; rows past ``recv_count`` are 0.
        recv_scales: ``[E_l, R * T, H / 128]`` fp32 (or ``[E_l, R * T, ceil(H / 512)]`` int32 with
            ``use_ue8m0``), None without fp8.
        recv_count: ``[E_l]`` int32, valid rows per local expert.
        recv_src_rank, recv_src_token, recv_src_topk: ``[E_l, R * T]`` int32: where each received row
            came from (rank, token, top-k slot); -1 past ``recv_count``.
        layout_range: ``[E_l, R, 2]`` int32: (first row, number of rows) of each source rank inside
            each local expert.
        active_ranks: ``[R]`` int32, the receiver's mask after the call (senders it timed out on are 0).
    """

    recv_x: np.ndarray
    recv_scales: np.ndarray | None
    recv_count: np.ndarray
    recv_src_rank: np.ndarray
    recv_src_token: np.ndarray
    recv_src_topk: np.ndarray
    layout_range: np.ndarray
    active_ranks: np.ndarray


def delivers(src_rank: int, dst_rank: int, ran: Sequence[bool], active_ranks: Sequence[np.ndarray]) -> bool:
    """Whether rows from ``src_rank`` reach ``dst_rank``: both ran and each sees the other as active."""
    return bool(
        ran[src_rank] and ran[dst_rank] and active_ranks[src_rank][dst_rank] and active_ranks[dst_rank][src_rank]
    )


def dispatch(
    rank: int,
    xs: Sequence[np.ndarray | None],
    topk_idxs: Sequence[np.ndarray | None],
    active_ranks: Sequence[np.ndarray],
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    *,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
) -> DispatchResult:
    """Rank ``rank``'s view of one low-latency dispatch.

    Args:
        rank: the receiving rank.
        xs: per rank, ``[t_r, H]`` bf16 tokens, or None for a rank that never ran.
        topk_idxs: per rank, ``[t_r, K]`` integer expert ids (``-1`` = none), or None.
        active_ranks: per rank, its ``[R]`` int32 mask as passed to the call.
        num_max_dispatch_tokens_per_rank: T.
        num_experts: E, a multiple of R.
        use_fp8, round_scale, use_ue8m0: as in :meth:`mooncake_ep.Buffer.dispatch`.

    Returns:
        The receiving rank's :class:`DispatchResult`.
    """
    num_ranks = len(xs)
    num_local_experts = num_experts // num_ranks
    hidden = next(x.shape[1] for x in xs if x is not None)
    num_rows = num_ranks * num_max_dispatch_tokens_per_rank
    ran = [x is not None for x in xs]

    if use_fp8:
        recv_x = np.zeros((num_local_experts, num_rows, hidden), dtype=float8_e4m3fn)
        scale_dtype = np.int32 if use_ue8m0 else np.float32
        recv_scales = np.zeros((num_local_experts, num_rows, num_scale_columns(hidden, use_ue8m0)), scale_dtype)
    else:
        recv_x = np.zeros((num_local_experts, num_rows, hidden), dtype=bfloat16)
        recv_scales = None
    recv_count = np.zeros(num_local_experts, dtype=np.int32)
    src_info = [np.full((num_local_experts, num_rows), -1, dtype=np.int32) for _ in range(3)]
    layout_range = np.zeros((num_local_experts, num_ranks, 2), dtype=np.int32)
    mask = np.array(active_ranks[rank], dtype=np.int32, copy=True)

    for src_rank in range(num_ranks):
        if not delivers(src_rank, rank, ran, active_ranks):
            # A rank we wait for but that sends nothing: the wait times out and masks it.
            if mask[src_rank]:
                mask[src_rank] = 0
            layout_range[:, src_rank, 0] = recv_count
            continue
        x, topk_idx = xs[src_rank], topk_idxs[src_rank]
        if use_fp8:
            payload, scales = quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
        else:
            payload, scales = x.astype(bfloat16), None
        slots = expert_slots(topk_idx, num_experts)
        for local_expert in range(num_local_experts):
            expert = rank * num_local_experts + local_expert
            tokens, topks = np.nonzero(topk_idx == expert)
            order = np.lexsort((slots[tokens, topks],))
            tokens, topks = tokens[order], topks[order]
            # recv_x holds T rows per (expert, source): copies past a source's first T to one expert
            # (only a token naming an expert twice makes them) are dropped, as the kernels drop them.
            kept = slots[tokens, topks] < num_max_dispatch_tokens_per_rank
            tokens, topks = tokens[kept], topks[kept]
            first = int(recv_count[local_expert])
            rows = slice(first, first + len(tokens))
            recv_x[local_expert, rows] = payload[tokens]
            if scales is not None:
                recv_scales[local_expert, rows] = scales[tokens]
            for info, value in zip(src_info, (src_rank, tokens, topks)):
                info[local_expert, rows] = value
            layout_range[local_expert, src_rank] = (first, len(tokens))
            recv_count[local_expert] += len(tokens)

    return DispatchResult(recv_x, recv_scales, recv_count, *src_info, layout_range, mask)


def combine(
    rank: int,
    expert_outs: Sequence[np.ndarray | None],
    dispatch_results: Sequence[DispatchResult | None],
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    active_ranks: Sequence[np.ndarray],
    *,
    renormalize: bool = False,
    dispatched_topk_idx: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s view of one low-latency combine.

    Args:
        rank: the rank that owns the tokens being combined.
        expert_outs: per rank, ``[E_l, R * T, H]`` bf16 expert outputs laid out like that rank's
            ``recv_x``, or None for a rank that did not run combine.
        dispatch_results: per rank, the :class:`DispatchResult` of the dispatch this combine answers
            (None for a rank that did not run it).
        topk_idx: ``[t, K]`` this rank's expert ids from that dispatch; an entry that names no
            expert here (-1, or outside [0, E)) adds nothing, whatever the dispatch sent for it.
        topk_weights: ``[t, K]`` fp32 routing weights.
        active_ranks: per rank, its ``[R]`` int32 mask as passed to combine.
        renormalize: rescale each token's live weights so they sum to the sum of all its weights
            (live weights summing to 0 are kept when that sum is 0 too, else dropped).
        dispatched_topk_idx: ``[t, K]`` the ids this rank gave that dispatch, where ``topk_idx``
            differs from them (-1 where the dispatch had an expert); None: ``topk_idx``. A copy the
            dispatch dropped (past this rank's first T to one expert) is an entry that names no
            expert, in the total under ``renormalize`` too, as the kernels take it.

    Returns:
        ``(combined_x [t, H] bf16, active_ranks [R] int32 after the call)``.
    """
    num_ranks = len(expert_outs)
    num_tokens, num_topk = topk_idx.shape
    mask = np.array(active_ranks[rank], dtype=np.int32, copy=True)
    ran = [out is not None and result is not None for out, result in zip(expert_outs, dispatch_results)]
    live = [delivers(expert_rank, rank, ran, active_ranks) for expert_rank in range(num_ranks)]
    for expert_rank in range(num_ranks):
        if not live[expert_rank] and mask[expert_rank]:
            mask[expert_rank] = 0  # an expert rank that answers nothing times out and is masked

    # Which row of its expert rank's output answers (token, k): the dispatch result says where each
    # received row came from, so index it by (source rank, token, k).
    hidden = next(out.shape[2] for out in expert_outs if out is not None)
    gathered = np.zeros((num_tokens, num_topk, hidden), dtype=np.float32)
    valid = np.zeros((num_tokens, num_topk), dtype=bool)
    for expert_rank, (out, result) in enumerate(zip(expert_outs, dispatch_results)):
        if not live[expert_rank]:
            continue
        # recv_src_rank is -1 past recv_count, so this selects exactly the valid rows from us.
        local_experts, rows = np.nonzero(result.recv_src_rank == rank)
        tokens = result.recv_src_token[local_experts, rows]
        topks = result.recv_src_topk[local_experts, rows]
        gathered[tokens, topks] = out[local_experts, rows].astype(np.float32)
        valid[tokens, topks] = True

    # An entry that names no expert (-1, or an id outside [0, E), which the kernels read as -1) adds
    # nothing, whatever the dispatch sent for it: the kernels take the experts from these ids. Nor
    # does a copy the dispatch dropped or never had (the kernels' slot -1), under renormalize too.
    num_experts = num_ranks * next(result.recv_count.shape[0] for result in dispatch_results if result is not None)
    num_max_dispatch_tokens_per_rank = next(result.recv_src_rank.shape[1] for result in dispatch_results
                                            if result is not None) // num_ranks
    dispatched = topk_idx if dispatched_topk_idx is None else dispatched_topk_idx
    slots = expert_slots(dispatched, num_experts)
    named = (topk_idx >= 0) & (topk_idx < num_experts) & (slots >= 0) & (slots < num_max_dispatch_tokens_per_rank)
    valid &= named
    weights = np.where(valid, topk_weights.astype(np.float32), np.float32(0))
    if renormalize:
        total = _warp_sum(np.where(named, topk_weights.astype(np.float32), np.float32(0)))
        kept = _warp_sum(weights)
        # Live weights summing to 0 cannot be scaled to another total (factor 0: the token gets
        # nothing), and need not be to a total of 0 (factor 1: weights that cancel, nothing lost).
        factor = np.where(kept != 0, total / np.where(kept != 0, kept, 1),
                          np.where(total == 0, np.float32(1), np.float32(0))).astype(np.float32)
        weights = (weights * factor[:, None]).astype(np.float32)
    acc = np.zeros((num_tokens, hidden), dtype=np.float32)
    for topk in range(num_topk):
        acc = np.where(valid[:, topk, None], _fmaf(weights[:, topk, None], gathered[:, topk], acc), acc)
    return acc.astype(bfloat16), mask


def _warp_sum(values: np.ndarray) -> np.ndarray:
    """Each row of ``[t, K]`` fp32 summed as common.cuh's ``warp_sum`` adds its 32 lanes (lane k
    holds entry k, the lanes past K 0): a butterfly over xor partners 16, 8, 4, 2, 1, in fp32."""
    lanes = np.zeros((values.shape[0], 32), dtype=np.float32)
    lanes[:, :values.shape[1]] = values
    partner = np.arange(32)
    for mask in (16, 8, 4, 2, 1):
        lanes = lanes + lanes[:, partner ^ mask]
    return lanes[:, 0]


def _fmaf(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 ``a * b + c`` rounded once, as CUDA's ``fmaf``.

    The product of two fp32 values is exact in fp64; the fp64 sum is not always, and rounding it
    to fp64 and then to fp32 can round twice. Rounded to odd instead (the sum's error, from
    TwoSum, forces the last bit to 1 when it is not 0), its cast to fp32 is the correctly
    rounded result: fp64 keeps more than 24 + 1 bits.
    """
    # inf - inf in the error term (inf or NaN operands, a sum past fp32) is NaN, and left out: quietly.
    with np.errstate(invalid="ignore", over="ignore"):
        product = a.astype(np.float64) * b.astype(np.float64)
        addend = c.astype(np.float64)
        total = product + addend
        virtual = total - product
        error = (product - (total - virtual)) + (addend - virtual)
        even = (total.view(np.uint64) & 1) == 0
        inexact = np.isfinite(error) & (error != 0) & even
        towards = np.where(error > 0, np.inf, -np.inf)
        return np.where(inexact, np.nextafter(total, towards), total).astype(np.float32)
