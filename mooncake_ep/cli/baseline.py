"""Low-latency dispatch and combine written with plain torch operations: the benchmark's baseline.

This is what a user would write without mooncake_ep, for in-process ranks given as lists of
per-rank tensors (CPU or CUDA, one device per rank or all on one): sort each rank's top-k copies by
expert, gather the token rows for each destination rank (``index_select``), copy them into the
receiver's ``[E_l, R * T, H]`` output (``index_copy_``), and for combine gather the rows back and
``index_add_`` the weighted rows in fp32. It uses nothing from mooncake_ep, so the benchmark can
report mooncake_ep's speed as a ratio to it; tests/test_bench.py checks it against
:mod:`mooncake_ep.reference` (bf16 and fp8 dispatch bit-exact, combine within bf16 rounding).

Layout, as mooncake_ep's (R ranks, E experts, E_l = E / R, T = num_max_dispatch_tokens_per_rank):
expert ``e`` lives on rank ``e // E_l`` as local expert ``e % E_l``; inside a local expert, rows are
ordered by source rank, then token, then top-k slot; rows past ``recv_count`` are undefined.

Note:
    :func:`dispatch` reads the ``[R, E]`` count matrix on the host once per call (``.tolist()``),
    as torch-native expert parallelism does to size its splits (``all_to_all_single`` takes host
    split sizes). That host sync is part of the baseline's cost, and why it cannot be captured in a
    CUDA graph: the benchmark times it on eager calls. Nothing else syncs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

# DeepEP's fp8 format, which mooncake_ep shares (tests/test_bench.py checks these equal its own):
# one fp32 scale per token per FP8_BLOCK channels, scale = max(amax, FP8_AMAX_FLOOR) / FP8_E4M3_MAX.
FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
FP8_AMAX_FLOOR = 1e-4  # so an all-zero block gets a finite, non-zero scale
# fp32(1/448), rounded once in fp32 as the kernels' compile-time constant is (a Python 1/448 would be
# rounded to fp64 first, then to fp32).
_INVERSE_E4M3_MAX = float(np.float32(1) / np.float32(FP8_E4M3_MAX))
NO_EXPERT = -1  # a topk_idx entry that names no expert


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
    """Where :func:`dispatch` put every copy: what :func:`combine` needs to bring the rows back.

    Attributes:
        copy_idx: ``copy_idx[src_rank][dst_rank]``: ``[n]`` int64 on src_rank's device, the copies
            src_rank sent to dst_rank as positions ``token * num_topk + k`` in its flattened topk_idx,
            in the order dst_rank stored them.
        token_idx: ``token_idx[src_rank][dst_rank]``: ``[n]`` int64 on src_rank's device, the token of
            each of those copies (``copy_idx // num_topk``).
        recv_row: ``recv_row[src_rank][dst_rank]``: ``[n]`` int64 on dst_rank's device, the row of
            each of those copies in dst_rank's recv_x viewed as ``[E_l * R * T, H]``.
    """

    copy_idx: list[list[torch.Tensor]]
    token_idx: list[list[torch.Tensor]]
    recv_row: list[list[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    """Every rank's view of one dispatch.

    Attributes:
        recv_x: per rank, ``[E_l, R * T, H]`` bf16, or float8_e4m3fn with fp8; rows past recv_count
            are undefined (allocated with ``torch.empty``).
        recv_scales: per rank, ``[E_l, R * T, H / 128]`` fp32 with fp8, else None.
        recv_count: per rank, ``[E_l]`` int32 valid rows per local expert, on that rank's device.
        layout: for :func:`combine`.
    """

    recv_x: list[torch.Tensor]
    recv_scales: list[torch.Tensor] | None
    recv_count: list[torch.Tensor]
    layout: DispatchLayout


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, H]`` bf16 → ``(q [n, H] float8_e4m3fn, scales [n, H / 128] fp32)``, one scale per 128 channels."""
    num_tokens, hidden = x.shape
    blocks = x.float().view(num_tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    # A NaN channel is left out of its block's amax, as in mooncake_ep (fmax): it stays NaN alone.
    amax = blocks.abs().nan_to_num(nan=0.0, posinf=math.inf).amax(dim=2).clamp_min(FP8_AMAX_FLOOR)
    # As mooncake_ep quantises (DeepEP's recipe): scale = amax * fp32(1/448), values times 448 / amax.
    # The division is tensor by tensor: CUDA torch turns a Python-scalar operand into a multiply by a
    # reciprocal, which rounds differently; a tensor one is a correctly rounded division, as on the CPU.
    scales = amax * torch.full_like(amax, _INVERSE_E4M3_MAX)
    multiplier = torch.full_like(amax, FP8_E4M3_MAX) / amax
    q = (blocks * multiplier.unsqueeze(2)).to(torch.float8_e4m3fn).view(num_tokens, hidden)
    return q, scales


def dispatch(xs: Sequence[torch.Tensor], topk_idxs: Sequence[torch.Tensor], num_max_dispatch_tokens_per_rank: int,
             num_experts: int, *, use_fp8: bool = True) -> DispatchResult:
    """Send each token to the ranks owning its top-k experts, for every in-process rank at once.

    Args:
        xs: per rank, ``[t_r, H]`` bf16 tokens on that rank's device, t_r <= T, H a multiple of 128.
        topk_idxs: per rank, ``[t_r, K]`` int64 (or int32) global expert ids, -1 = no expert, on the
            same device as that rank's tokens. A rank may send each expert at most T copies.
        num_max_dispatch_tokens_per_rank: T.
        num_experts: E, a multiple of the number of ranks.
        use_fp8: quantise to e4m3 with one fp32 scale per token per 128 channels.

    Returns:
        The :class:`DispatchResult` of every rank.
    """
    num_ranks = len(xs)
    num_local_experts = num_experts // num_ranks
    num_rows = num_ranks * num_max_dispatch_tokens_per_rank
    hidden = xs[0].shape[1]
    devices = [x.device for x in xs]

    # Each source's copies sorted by expert; stable, so within an expert by token, then k. -1 sorts first.
    flats = [topk.reshape(-1).long() for topk in topk_idxs]
    orders = [torch.argsort(flat, stable=True) for flat in flats]
    sorted_experts = [flat[order] for flat, order in zip(flats, orders)]
    # counts[s, 1 + e] = copies rank s sends expert e; counts[s, 0] = its -1 entries. scatter_add_,
    # not bincount, which reads its input's maximum on the host.
    counts = torch.stack([
        torch.zeros(num_experts + 1, dtype=torch.int64, device=devices[0]).scatter_add_(
            0, (flat + 1).to(devices[0]), torch.ones_like(flat, device=devices[0]))
        for flat in flats])
    counts_host = counts.tolist()  # the one host sync: slicing needs the split sizes

    # Row of each copy in its receiver: its expert's first row for this source (the copies of lower
    # source ranks come first) plus its rank among this source's copies of that expert.
    expert_counts = counts[:, 1:]
    source_base = expert_counts.cumsum(0) - expert_counts  # [R, E] rows of lower source ranks
    sorted_start = (counts.cumsum(1) - counts)[:, 1:]  # [R, E] first sorted position of each expert
    local_expert = torch.arange(num_experts, device=devices[0]) % num_local_experts
    row_offset = local_expert * num_rows + source_base - sorted_start  # [R, E]; + sorted position = row

    recv_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    recv_x = [torch.empty((num_local_experts, num_rows, hidden), dtype=recv_dtype, device=d) for d in devices]
    recv_scales = ([torch.empty((num_local_experts, num_rows, hidden // FP8_BLOCK), dtype=torch.float32, device=d)
                    for d in devices] if use_fp8 else None)
    # index_copy_ has no fp8 kernel: fp8 rows move as their bytes.
    recv_flat = [r.view(torch.uint8) if use_fp8 else r for r in recv_x]
    recv_flat = [r.view(-1, r.shape[-1]) for r in recv_flat]
    recv_count = [expert_counts[:, d * num_local_experts:(d + 1) * num_local_experts].sum(0).to(torch.int32)
                  .to(devices[d]) for d in range(num_ranks)]

    layout = DispatchLayout([], [], [])
    for src in range(num_ranks):
        num_topk = topk_idxs[src].shape[1]
        if use_fp8:
            q, scales = quantize_fp8(xs[src])
            payload = q.view(torch.uint8)
        else:
            payload, scales = xs[src], None
        positions = torch.arange(sorted_experts[src].numel(), device=devices[src])
        rows = row_offset[src].to(devices[src])[sorted_experts[src].clamp_min(0)] + positions  # -1 rows: unused
        copy_idx, token_idx, recv_row = [], [], []
        first = counts_host[src][0]  # the -1 entries sort first and go nowhere
        for dst in range(num_ranks):
            num_copies = sum(counts_host[src][1 + dst * num_local_experts:1 + (dst + 1) * num_local_experts])
            copies = orders[src][first:first + num_copies]
            tokens = copies // num_topk
            dst_rows = rows[first:first + num_copies].to(devices[dst])
            first += num_copies
            copy_idx.append(copies)
            token_idx.append(tokens)
            recv_row.append(dst_rows)
            if num_copies == 0:
                continue
            recv_flat[dst].index_copy_(0, dst_rows, payload.index_select(0, tokens).to(devices[dst]))
            if scales is not None:
                recv_scales[dst].view(-1, scales.shape[1]).index_copy_(
                    0, dst_rows, scales.index_select(0, tokens).to(devices[dst]))
        layout.copy_idx.append(copy_idx)
        layout.token_idx.append(token_idx)
        layout.recv_row.append(recv_row)
    return DispatchResult(recv_x, recv_scales, recv_count, layout)


def combine(expert_outs: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor],
            layout: DispatchLayout) -> list[torch.Tensor]:
    """Bring expert outputs back to the tokens' ranks and sum them with the routing weights.

    Args:
        expert_outs: per rank, ``[E_l, R * T, H]`` bf16 expert outputs laid out as its recv_x.
        topk_weights: per rank, ``[t_r, K]`` fp32 routing weights, on that rank's device.
        layout: the :class:`DispatchLayout` of the dispatch this combine answers.

    Returns:
        Per rank, ``[t_r, H]`` bf16: the fp32 sum of weight x expert output over the token's copies
        that were dispatched (-1 entries add nothing), rounded to bf16 once.
    """
    num_ranks = len(expert_outs)
    combined = []
    for owner in range(num_ranks):
        weights = topk_weights[owner]
        hidden = expert_outs[owner].shape[-1]
        flat_weights = weights.reshape(-1).float()
        acc = torch.zeros((weights.shape[0], hidden), dtype=torch.float32, device=weights.device)
        for expert_rank in range(num_ranks):
            copies = layout.copy_idx[owner][expert_rank]
            if copies.numel() == 0:
                continue
            rows = expert_outs[expert_rank].view(-1, hidden).index_select(0, layout.recv_row[owner][expert_rank])
            rows = rows.to(weights.device).float() * flat_weights.index_select(0, copies).unsqueeze(1)
            acc.index_add_(0, layout.token_idx[owner][expert_rank], rows)
        combined.append(acc.to(torch.bfloat16))
    return combined
