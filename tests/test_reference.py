"""Tests of mooncake_ep.reference, the numpy semantics every backend is compared against.

Hand-checked cases use values that bf16, fp8 and fp32 hold exactly (small integers, powers of two),
so expected results are written out literally. Token rows encode their origin: every channel of
rank s's token t holds 10 * s + t + 1 (exact in bf16 for the sizes used), so a misrouted row names
its source. Random cases check the same rules against independent numpy computations.
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from mooncake_ep import reference
from mooncake_ep._constants import FP8_AMAX_FLOOR, FP8_BLOCK, FP8_E4M3_MAX

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of the value, hence of the
# block amax (every value of a block is scaled by the same factor, and |x / scale| <= 448).
FP8_REL_ERROR = 2.0**-4
# bf16 keeps 8 significant bits: one rounding errs by at most 2^-9 relative; 2^-8 leaves margin for
# the fp32 accumulation in front of it.
BF16_REL_ERROR = 2.0**-8


def origin_rows(rank: int, num_tokens: int, hidden: int) -> np.ndarray:
    """``[num_tokens, hidden]`` bf16: every channel of token t holds 10 * rank + t + 1."""
    values = 10 * rank + np.arange(num_tokens, dtype=np.float32) + 1
    return np.repeat(values[:, None], hidden, axis=1).astype(BF16)


def topk(rows: list[list[int]], num_topk: int | None = None) -> np.ndarray:
    num_topk = num_topk if num_topk is not None else (len(rows[0]) if rows else 1)
    return np.array(rows, dtype=np.int64).reshape(len(rows), num_topk)


def random_topk(rng: np.random.Generator, num_tokens: int, num_topk: int, num_experts: int,
                p_none: float = 0.2) -> np.ndarray:
    """Distinct experts per token (as a router picks them), some entries -1."""
    idx = np.array([rng.permutation(num_experts)[:num_topk] for _ in range(num_tokens)], np.int64)
    idx = idx.reshape(num_tokens, num_topk)
    idx[rng.random(idx.shape) < p_none] = -1
    return idx.astype(np.int64)


def ones(num_ranks: int) -> list[np.ndarray]:
    return [np.ones(num_ranks, np.int32) for _ in range(num_ranks)]


def scale_exponent(scale: np.ndarray) -> np.ndarray:
    """The biased 8-bit exponent of fp32 values."""
    return (np.asarray(scale, np.float32).view(np.uint32) >> 23) & 0xFF


def received(result: reference.DispatchResult, local_expert: int) -> list[tuple[int, int, int]]:
    count = int(result.recv_count[local_expert])
    return [(int(result.recv_src_rank[local_expert, i]), int(result.recv_src_token[local_expert, i]),
             int(result.recv_src_topk[local_expert, i])) for i in range(count)]


# --- fp8 quantisation --------------------------------------------------------------------------------


def blocks_with_amax(amaxes: list[float], num_tokens: int = 2) -> np.ndarray:
    """``[num_tokens, 128 * len(amaxes)]`` bf16; block j holds values up to amaxes[j] (its amax exactly)."""
    rng = np.random.default_rng(0)
    blocks = []
    for amax in amaxes:
        block = rng.uniform(-1, 1, size=(num_tokens, FP8_BLOCK)) * amax
        block[:, 7] = amax  # the amax itself, with both signs in the block
        block[:, 9] = -amax
        blocks.append(block)
    x = np.concatenate(blocks, axis=1).astype(BF16)
    return x


def recipe_scale(amax: float) -> np.float32:
    """DeepEP's scale of a block, as the kernels compute it: the fp32 amax times fp32(1/448), two
    roundings (1/448, then the product), which is not always the one rounding of amax / 448."""
    return np.float32(amax) * (np.float32(1) / np.float32(FP8_E4M3_MAX))


def test_scale_is_amax_over_448_with_floor():
    """The scale is amax * fp32(1/448), bit for bit, the floor standing in for an amax below it. The
    amaxes 3 and 1.5 are ones where that product and amax / 448 differ in the last bit (checked
    here), so a reference dividing instead would fail."""
    amaxes = [448.0, 1.0, 3.5, 0.0, 3.0, 1.5]
    for amax in (3.0, 1.5):
        assert recipe_scale(amax) != np.float32(amax) / np.float32(FP8_E4M3_MAX)
    x = blocks_with_amax(amaxes)
    q, scales = reference.quantize_fp8(x, round_scale=False, use_ue8m0=False)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scales.dtype == np.float32 and scales.shape == (2, 6)
    expected = [recipe_scale(max(amax, FP8_AMAX_FLOOR)) for amax in amaxes]
    assert expected[0] == np.float32(1.0)
    for token in range(2):
        np.testing.assert_array_equal(scales[token], np.array(expected, np.float32))
    # The amax element lands on the largest e4m3 value (the multiplier is 448 / amax, one division).
    q32 = q.astype(np.float32).reshape(2, 6, FP8_BLOCK)
    np.testing.assert_array_equal(np.abs(q32[:, [0, 1, 2, 4, 5]]).max(axis=2), FP8_E4M3_MAX)


def test_amax_below_floor_uses_the_floor():
    x = np.full((1, FP8_BLOCK), 1e-6, np.float32).astype(BF16)
    q, scales = reference.quantize_fp8(x, round_scale=False, use_ue8m0=False)
    assert scales[0, 0] == recipe_scale(FP8_AMAX_FLOOR)
    assert np.all(q.astype(np.float32) < FP8_E4M3_MAX)


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_all_zero_blocks(round_scale, use_ue8m0):
    x = np.zeros((3, 3 * FP8_BLOCK), BF16)
    x[1, FP8_BLOCK:2 * FP8_BLOCK] = 2.0  # one block of one token is not zero
    q, scales = reference.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert np.all(np.isfinite(q.astype(np.float32)))
    zero = q.astype(np.float32).reshape(3, 3, FP8_BLOCK)
    zero[1, 1] = 0
    assert not zero.any()
    if not use_ue8m0:
        assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    deq = reference.dequantize_fp8(q, scales, use_ue8m0=use_ue8m0)
    np.testing.assert_array_equal(deq, x.astype(np.float32))  # 2.0 and 0.0 survive exactly


@pytest.mark.parametrize("amax,expected", [
    (448.0, 1.0),          # already a power of two: unchanged
    (224.0, 0.5),
    (300.0, 1.0),          # 300 / 448 = 0.67 rounds up
    (1.0, 2.0**-8),        # 1 / 448 = 2^-8.8 rounds up
    (448.0 * 2**5, 32.0),
    (0.0, 2.0**-22),       # the floor: 1e-4 / 448 = 2.2e-7, between 2^-23 and 2^-22
])
def test_round_scale_rounds_up_to_a_power_of_two(amax, expected):
    x = blocks_with_amax([amax], num_tokens=1)
    _, scales = reference.quantize_fp8(x, round_scale=True, use_ue8m0=False)
    assert scales[0, 0] == np.float32(expected)


def test_round_scale_random_blocks_are_powers_of_two_at_least_the_scale():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((16, 8 * FP8_BLOCK)) * 10.0 ** rng.uniform(-6, 4, size=(16, 1))).astype(BF16)
    _, plain = reference.quantize_fp8(x, round_scale=False, use_ue8m0=False)
    _, rounded = reference.quantize_fp8(x, round_scale=True, use_ue8m0=False)
    mantissa = rounded.view(np.uint32) & 0x7FFFFF
    assert not mantissa.any()
    assert np.all(rounded >= plain) and np.all(rounded < 2 * plain)


@pytest.mark.parametrize("hidden,num_words", [(128, 1), (512, 1), (640, 2), (1152, 3)])
def test_ue8m0_scale_columns(hidden, num_words):
    assert reference.num_scale_columns(hidden, True) == num_words
    assert reference.num_scale_columns(hidden, False) == hidden // FP8_BLOCK
    x = np.ones((2, hidden), BF16)
    _, scales = reference.quantize_fp8(x, round_scale=True, use_ue8m0=True)
    assert scales.dtype == np.int32 and scales.shape == (2, num_words)


def test_ue8m0_packs_exponent_of_block_j_in_byte_j_mod_4_of_word_j_div_4():
    # Block j has amax 448 * 2^p[j], so its scale is exactly 2^p[j] and its byte is 127 + p[j].
    powers = [-3, -1, 0, 2, 5]
    x = blocks_with_amax([448.0 * 2.0**p for p in powers], num_tokens=1)
    _, words = reference.quantize_fp8(x, round_scale=True, use_ue8m0=True)
    exponent_bytes = [127 + p for p in powers] + [0, 0, 0]  # padded to whole words with zeros
    expected = []
    for w in range(2):
        word = sum(exponent_bytes[4 * w + i] << (8 * i) for i in range(4))
        expected.append(word - (1 << 32) if word >= 1 << 31 else word)  # as a signed int32
    assert expected[0] < 0  # byte 3 = 130 sets the sign bit: packing must not saturate
    np.testing.assert_array_equal(words[0], np.array(expected, np.int32))


def test_ue8m0_bytes_are_the_exponents_of_the_rounded_scales():
    rng = np.random.default_rng(2)
    hidden = 7 * FP8_BLOCK
    x = (rng.standard_normal((8, hidden)) * 10.0 ** rng.uniform(-5, 4, size=(8, 7)).repeat(FP8_BLOCK, 1)).astype(BF16)
    _, rounded = reference.quantize_fp8(x, round_scale=True, use_ue8m0=False)
    _, words = reference.quantize_fp8(x, round_scale=True, use_ue8m0=True)
    words = words.astype(np.int64) & 0xFFFFFFFF
    for j in range(7):
        byte = (words[:, j // 4] >> (8 * (j % 4))) & 0xFF
        np.testing.assert_array_equal(byte, scale_exponent(rounded[:, j]))
    assert not ((words[:, 1] >> 24) & 0xFF).any()  # byte 7 is padding


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_dequantize_round_trip_within_fp8_error_of_block_amax(round_scale, use_ue8m0):
    rng = np.random.default_rng(3)
    num_tokens, num_blocks = 12, 6
    magnitude = 10.0 ** rng.uniform(-6, 4, size=(num_tokens, num_blocks)).repeat(FP8_BLOCK, 1)
    x = (rng.standard_normal((num_tokens, num_blocks * FP8_BLOCK)) * magnitude).astype(BF16)
    x[0, :FP8_BLOCK] = 0  # an all-zero block
    q, scales = reference.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0)
    assert not np.isnan(q.astype(np.float32)).any()
    deq = reference.dequantize_fp8(q, scales, use_ue8m0=use_ue8m0)
    assert deq.dtype == np.float32 and deq.shape == x.shape
    x32 = x.astype(np.float32).reshape(num_tokens, num_blocks, FP8_BLOCK)
    amax = np.abs(x32).max(axis=2, keepdims=True)
    error = np.abs(deq.reshape(x32.shape) - x32)
    assert np.all(error <= FP8_REL_ERROR * amax)
    if use_ue8m0:  # the packed exponents decode to the same scales as the fp32 ones
        q2, plain = reference.quantize_fp8(x, round_scale=True, use_ue8m0=False)
        np.testing.assert_array_equal(q.view(np.uint8), q2.view(np.uint8))
        np.testing.assert_array_equal(deq, reference.dequantize_fp8(q2, plain, use_ue8m0=False))


@pytest.mark.parametrize("round_scale", [False, True])
def test_every_nan_quantises_to_the_canonical_e4m3_nan(round_scale):
    """The kernels' saturating conversion (cvt.rn.satfinite.e4m3x2.f32) writes one NaN, 0x7F, whatever
    the sign of the NaN it converts; the reference's cast kept the sign: 0xFF for -NaN (helper-115)."""
    x = np.ones((1, FP8_BLOCK), np.float32)
    x[0, 0], x[0, 1] = -np.nan, np.nan
    x = x.astype(BF16)
    assert list(x.view(np.uint16)[0, :2]) == [0xFFC0, 0x7FC0]
    q, _ = reference.quantize_fp8(x, round_scale=round_scale, use_ue8m0=False)
    assert list(q.view(np.uint8)[0, :2]) == [0x7F, 0x7F]


def test_ue8m0_scales_without_round_scale_are_refused():
    """The exponent byte of a scale that is no power of two is not that scale: DeepEP asserts, the Buffer
    refuses, and the oracle returned scales that dequantised 3.0 to 1.75."""
    with pytest.raises(ValueError, match="use_ue8m0 requires round_scale"):
        reference.quantize_fp8(np.ones((1, FP8_BLOCK), BF16), round_scale=False, use_ue8m0=True)


@pytest.mark.parametrize("round_scale", [False, True])
def test_a_nan_channel_stays_nan_alone_and_the_block_is_scaled_by_the_rest(round_scale):
    """The kernels' fmaxf leaves NaN out of a block's amax; so does the reference (np.max spread the
    NaN into the scale and so into every value of the block)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 2 * FP8_BLOCK)).astype(np.float32)
    clean = x.astype(BF16)
    x[0, 5] = np.nan
    q, scales = reference.quantize_fp8(x.astype(BF16), round_scale=round_scale, use_ue8m0=False)
    q_clean, scales_clean = reference.quantize_fp8(clean, round_scale=round_scale, use_ue8m0=False)
    zeroed = clean.copy()  # the NaN's channel as a zero, which leaves the block's amax to the others
    zeroed[0, 5] = 0
    want = reference.quantize_fp8(zeroed, round_scale=round_scale, use_ue8m0=False)
    assert np.isnan(q.astype(np.float32)[0, 5]) and np.isfinite(scales).all()
    assert scales[0, 0] == want[1][0, 0]
    others = np.ones(q.shape, bool)
    others[0, 5] = False
    np.testing.assert_array_equal(q.view(np.uint8)[others], want[0].view(np.uint8)[others])
    np.testing.assert_array_equal(q.view(np.uint8)[1], q_clean.view(np.uint8)[1])
    np.testing.assert_array_equal(scales[1], scales_clean[1])


def test_quantize_zero_tokens():
    q, scales = reference.quantize_fp8(np.zeros((0, 256), BF16), round_scale=True, use_ue8m0=True)
    assert q.shape == (0, 256) and scales.shape == (0, 1)


# --- dispatch ----------------------------------------------------------------------------------------

# Two ranks, four experts (rank 0 owns 0 and 1, rank 1 owns 2 and 3), T = 3, hidden 128.
HAND_TOPK = [
    topk([[1, 2], [-1, 0], [0, 3]]),  # rank 0, three tokens
    topk([[2, 0], [1, -1]]),          # rank 1, two tokens
]
# What each (receiving rank, local expert) gets, as (source rank, token, k), in order.
HAND_RECEIVED = {
    (0, 0): [(0, 1, 1), (0, 2, 0), (1, 0, 1)],
    (0, 1): [(0, 0, 0), (1, 1, 0)],
    (1, 0): [(0, 0, 1), (1, 0, 0)],
    (1, 1): [(0, 2, 1)],
}


def hand_dispatch(rank: int, **flags) -> reference.DispatchResult:
    xs = [origin_rows(0, 3, 128), origin_rows(1, 2, 128)]
    return reference.dispatch(rank, xs, HAND_TOPK, ones(2), 3, 4, **flags)


@pytest.mark.parametrize("rank", [0, 1])
def test_dispatch_hand_checked_order_and_rows(rank):
    result = hand_dispatch(rank, use_fp8=False)
    assert result.recv_x.dtype == BF16 and result.recv_x.shape == (2, 6, 128)
    assert result.recv_scales is None
    assert result.recv_count.dtype == np.int32
    np.testing.assert_array_equal(result.recv_count, [len(HAND_RECEIVED[rank, e]) for e in range(2)])
    for local_expert in range(2):
        rows = received(result, local_expert)
        assert rows == HAND_RECEIVED[rank, local_expert]
        for i, (src, token, _) in enumerate(rows):
            assert np.all(result.recv_x[local_expert, i].astype(np.float32) == 10 * src + token + 1)
        # Past recv_count: the reference's zeros and -1 source info.
        assert not result.recv_x[local_expert, len(rows):].astype(np.float32).any()
        assert np.all(result.recv_src_rank[local_expert, len(rows):] == -1)
    np.testing.assert_array_equal(result.active_ranks, [1, 1])


def test_dispatch_layout_range_is_first_row_and_count_per_source():
    result = hand_dispatch(0, use_fp8=False)
    np.testing.assert_array_equal(result.layout_range[0], [[0, 2], [2, 1]])
    np.testing.assert_array_equal(result.layout_range[1], [[0, 1], [1, 1]])


def test_dispatch_orders_repeated_expert_by_k():
    # One token naming expert 0 twice: its rows follow k (the rows still fit in R * T).
    xs = [origin_rows(0, 2, 128)]
    result = reference.dispatch(0, xs, [topk([[0, 1, 0], [0, -1, -1]])], ones(1), 4, 2, use_fp8=False)
    assert received(result, 0) == [(0, 0, 0), (0, 0, 2), (0, 1, 0)]
    assert received(result, 1) == [(0, 0, 1)]


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_dispatch_drops_a_sources_copies_past_its_first_t_to_one_expert(num_ranks):
    # T = 2: rank 0 sends expert 0 three copies (token 0 names it twice), the third in (token, k)
    # order past its T rows: dropped, as the kernels drop it (slot -1), and so left out of combine.
    num_experts = 2 * num_ranks
    xs = [origin_rows(src, 2, 128) for src in range(num_ranks)]
    topks = [topk([[0, 0], [0, 1]])] + [topk([[0, -1], [-1, -1]])] * (num_ranks - 1)
    result = reference.dispatch(0, xs, topks, ones(num_ranks), 2, num_experts, use_fp8=False)
    assert received(result, 0) == [(0, 0, 0), (0, 0, 1)] + [(src, 0, 0) for src in range(1, num_ranks)]
    np.testing.assert_array_equal(result.layout_range[0, 0], [0, 2])
    assert result.recv_count[0] == 2 + (num_ranks - 1)
    if num_ranks == 1:  # token 1's copy to expert 0 was dropped: it gets expert 1's output alone
        combined, _ = reference.combine(0, [np.ones((2, 2, 128), BF16)], [result], topks[0],
                                        np.ones((2, 2), np.float32), ones(1))
        np.testing.assert_array_equal(combined.astype(np.float32)[:, 0], [2, 1])
        # Nor is it in token 1's total under renormalize (the kernels' slot -1): expert 1's weight
        # alone is the total, so nothing is rescaled.
        combined, _ = reference.combine(0, [np.ones((2, 2, 128), BF16)], [result], topks[0],
                                        np.ones((2, 2), np.float32), ones(1), renormalize=True)
        np.testing.assert_array_equal(combined.astype(np.float32)[:, 0], [2, 1])
        # The slots are the dispatch's: a combine that leaves out token 0's second copy (-1) still has
        # token 1's copy dropped, and then that -1 is out of token 0's total.
        combine_ids = topk([[0, -1], [0, 1]])
        combined, _ = reference.combine(0, [np.ones((2, 2, 128), BF16)], [result], combine_ids,
                                        np.ones((2, 2), np.float32), ones(1), renormalize=True,
                                        dispatched_topk_idx=topks[0])
        np.testing.assert_array_equal(combined.astype(np.float32)[:, 0], [1, 1])


@pytest.mark.parametrize("round_scale,use_ue8m0", [(False, False), (True, False), (True, True)])
def test_dispatch_fp8_rows_are_quantized_source_rows(round_scale, use_ue8m0):
    flags = dict(use_fp8=True, round_scale=round_scale, use_ue8m0=use_ue8m0)
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((3, 256)).astype(BF16), rng.standard_normal((2, 256)).astype(BF16)]
    quantized = [reference.quantize_fp8(x, round_scale=round_scale, use_ue8m0=use_ue8m0) for x in xs]
    for rank in range(2):
        result = reference.dispatch(rank, xs, HAND_TOPK, ones(2), 3, 4, **flags)
        assert result.recv_x.dtype == FP8
        assert result.recv_scales.dtype == (np.int32 if use_ue8m0 else np.float32)
        assert result.recv_scales.shape == (2, 6, reference.num_scale_columns(256, use_ue8m0))
        for local_expert in range(2):
            for i, (src, token, _) in enumerate(received(result, local_expert)):
                q, scales = quantized[src]
                np.testing.assert_array_equal(result.recv_x[local_expert, i].view(np.uint8), q[token].view(np.uint8))
                np.testing.assert_array_equal(result.recv_scales[local_expert, i], scales[token])


@pytest.mark.parametrize("seed", range(4))
def test_dispatch_random_counts_are_histogram_and_rows_are_sources(seed):
    rng = np.random.default_rng(seed)
    num_ranks, num_local_experts, num_topk, num_max_tokens, hidden = 4, 3, 4, 6, 128
    num_experts = num_ranks * num_local_experts
    num_tokens = rng.integers(0, num_max_tokens + 1, size=num_ranks)
    num_tokens[seed % num_ranks] = 0  # at least one rank with no tokens
    xs = [rng.standard_normal((t, hidden)).astype(BF16) for t in num_tokens]
    topk_idxs = [random_topk(rng, t, num_topk, num_experts) for t in num_tokens]
    histogram = sum(np.bincount(idx[idx >= 0], minlength=num_experts) for idx in topk_idxs)
    for rank in range(num_ranks):
        result = reference.dispatch(rank, xs, topk_idxs, ones(num_ranks), num_max_tokens, num_experts, use_fp8=False)
        own = slice(rank * num_local_experts, (rank + 1) * num_local_experts)
        np.testing.assert_array_equal(result.recv_count, histogram[own])
        np.testing.assert_array_equal(result.active_ranks, 1)  # a rank with no tokens is alive
        for local_expert in range(num_local_experts):
            rows = received(result, local_expert)
            assert rows == sorted(rows) and len(set(rows)) == len(rows)  # (source rank, token, k) order
            for i, (src, token, k) in enumerate(rows):
                assert topk_idxs[src][token, k] == rank * num_local_experts + local_expert
                np.testing.assert_array_equal(result.recv_x[local_expert, i].view(np.uint16),
                                              xs[src][token].view(np.uint16))


def test_dispatch_minus_one_entries_and_no_tokens_send_nothing():
    xs = [origin_rows(0, 2, 128), np.zeros((0, 128), BF16)]
    topk_idxs = [topk([[-1, -1], [-1, 3]]), np.zeros((0, 2), np.int64)]
    results = [reference.dispatch(r, xs, topk_idxs, ones(2), 2, 4, use_fp8=False) for r in range(2)]
    np.testing.assert_array_equal(results[0].recv_count, [0, 0])
    np.testing.assert_array_equal(results[1].recv_count, [0, 1])
    assert received(results[1], 1) == [(0, 1, 1)]
    for result in results:
        np.testing.assert_array_equal(result.active_ranks, [1, 1])


def test_dispatch_int32_topk_equals_int64():
    xs = [origin_rows(0, 3, 128), origin_rows(1, 2, 128)]
    as32 = [idx.astype(np.int32) for idx in HAND_TOPK]
    for rank in range(2):
        a = reference.dispatch(rank, xs, HAND_TOPK, ones(2), 3, 4, use_fp8=False)
        b = reference.dispatch(rank, xs, as32, ones(2), 3, 4, use_fp8=False)
        np.testing.assert_array_equal(a.recv_count, b.recv_count)
        np.testing.assert_array_equal(a.recv_src_token, b.recv_src_token)


# Three ranks, six experts (rank r owns 2r and 2r+1); every token goes to one expert of every rank.
THREE_TOPK = [topk([[0, 2, 4], [1, 3, 5]]) for _ in range(3)]
THREE_XS = [origin_rows(r, 2, 128) for r in range(3)]


def sources(result: reference.DispatchResult) -> set[int]:
    return {src for e in range(result.recv_count.shape[0]) for src, _, _ in received(result, e)}


def test_dispatch_receiver_masking_a_sender_gets_nothing_from_it_and_sender_skips_it():
    actives = ones(3)
    actives[2] = np.array([0, 1, 1], np.int32)  # rank 2 sees rank 0 as dead; rank 0 does not know
    results = [reference.dispatch(r, THREE_XS, THREE_TOPK, actives, 2, 6, use_fp8=False) for r in range(3)]
    # Rank 2 skips rank 0 when sending, so rank 0 waits for it, times out and masks it.
    assert sources(results[0]) == {0, 1}
    np.testing.assert_array_equal(results[0].active_ranks, [1, 1, 0])
    assert sources(results[1]) == {0, 1, 2}
    np.testing.assert_array_equal(results[1].active_ranks, [1, 1, 1])
    assert sources(results[2]) == {1, 2}
    np.testing.assert_array_equal(results[2].active_ranks, [0, 1, 1])
    np.testing.assert_array_equal(results[0].recv_count, [2, 2])  # one row per live source
    np.testing.assert_array_equal(results[1].recv_count, [3, 3])


def test_dispatch_rank_that_never_ran_delivers_nothing_and_is_masked():
    xs = [THREE_XS[0], None, THREE_XS[2]]
    topk_idxs = [THREE_TOPK[0], None, THREE_TOPK[2]]
    for rank in (0, 2):
        result = reference.dispatch(rank, xs, topk_idxs, ones(3), 2, 6, use_fp8=False)
        assert sources(result) == {0, 2}
        expected_mask = [1, 0, 1]
        np.testing.assert_array_equal(result.active_ranks, expected_mask)
        np.testing.assert_array_equal(result.recv_count, [2, 2])
        assert np.all(result.layout_range[:, 1, 1] == 0)
        # Its empty range starts where the next source's does (after source 0's rows), as any source's.
        np.testing.assert_array_equal(result.layout_range[:, 1, 0], result.layout_range[:, 0, 1])
        np.testing.assert_array_equal(result.layout_range[:, 1, 0], result.layout_range[:, 2, 0])


def test_dispatch_does_not_modify_inputs():
    actives = ones(3)
    actives[2][0] = 0
    copies = [a.copy() for a in actives]
    reference.dispatch(0, THREE_XS, THREE_TOPK, actives, 2, 6, use_fp8=True)
    for a, b in zip(actives, copies):
        np.testing.assert_array_equal(a, b)


# --- combine -----------------------------------------------------------------------------------------


def scaled_expert_outs(results: list[reference.DispatchResult | None], num_local_experts: int) -> list:
    """Expert e multiplies its rows by e + 1 (exact in bf16 for the small values used here)."""
    outs = []
    for rank, result in enumerate(results):
        if result is None:
            outs.append(None)
            continue
        factor = (rank * num_local_experts + np.arange(num_local_experts) + 1).astype(np.float32)
        outs.append((result.recv_x.astype(np.float32) * factor[:, None, None]).astype(BF16))
    return outs


def test_combine_hand_checked():
    results = [hand_dispatch(r, use_fp8=False) for r in range(2)]
    outs = scaled_expert_outs(results, 2)
    weights = [np.array([[0.5, 0.25], [4.0, 2.0], [1.0, 0.125]], np.float32),
               np.array([[1.0, 1.0], [0.5, 8.0]], np.float32)]
    # token value v = 10 * rank + t + 1, expert e returns (e + 1) * v; -1 entries contribute nothing.
    expected = [
        [0.5 * 2 * 1 + 0.25 * 3 * 1, 2.0 * 1 * 2, 1.0 * 1 * 3 + 0.125 * 4 * 3],
        [1.0 * 3 * 11 + 1.0 * 1 * 11, 0.5 * 2 * 12],
    ]
    for rank in range(2):
        combined, mask = reference.combine(rank, outs, results, HAND_TOPK[rank], weights[rank], ones(2))
        assert combined.dtype == BF16 and combined.shape == (len(expected[rank]), 128)
        np.testing.assert_array_equal(combined.astype(np.float32), np.repeat(np.array(expected[rank])[:, None],
                                                                               128, axis=1))
        np.testing.assert_array_equal(mask, [1, 1])


def test_combine_accumulates_in_fp32_and_rounds_to_bf16_once():
    # 1 + 3 * 2^-9: each 2^-9 alone is below half a bf16 ulp of 1 (2^-8), their fp32 sum is above it.
    # Accumulating in bf16 would give 1.0; fp32 then one rounding gives 1 + 2^-7.
    xs = [np.ones((1, 128), BF16)]
    topk_idx = topk([[0, 1, 2, 3]])
    result = reference.dispatch(0, xs, [topk_idx], ones(1), 1, 4, use_fp8=False)
    weights = np.array([[1.0, 2.0**-9, 2.0**-9, 2.0**-9]], np.float32)
    combined, _ = reference.combine(0, [result.recv_x], [result], topk_idx, weights, ones(1))
    assert np.all(combined.astype(np.float32) == np.float32(1 + 2.0**-7))


def _combine_one_token(expert_values: list[float], weights: list[float]) -> np.float32:
    """Combine of one token routed to experts 0, 1, ... (one rank), expert e's output rows all expert_values[e]."""
    num_topk = len(expert_values)
    topk_idx = topk([list(range(num_topk))])
    result = reference.dispatch(0, [np.ones((1, 128), BF16)], [topk_idx], ones(1), 1, num_topk, use_fp8=False)
    outs = np.zeros_like(result.recv_x)
    for expert, value in enumerate(expert_values):
        outs[expert] = BF16.type(value)
    combined, _ = reference.combine(0, [outs], [result], topk_idx, np.array([weights], np.float32), ones(1))
    assert np.all(combined == combined[0, 0])
    return combined[0, 0].astype(np.float32)


def test_combine_sums_in_k_order_with_one_fused_rounding_per_step():
    """The kernels' rule: acc = fmaf(w_k, x_k, acc) for k = 0, 1, ..., in fp32. Pinned on values where
    another order, or a rounded product before the add, gives another bf16 result."""
    # In k order, 2^24 + 1 rounds back to 2^24 (ties to even) and the -2^24 cancels it: 0. In reverse
    # order, -2^24 + 1 is exact and the sum is 1.
    assert _combine_one_token([1.0, 1.0, 1.0], [2.0**24, 1.0, -(2.0**24)]) == 0
    # Step 0 puts -fl32(w1 * x1) in acc; a fused step 1 leaves the product's rounding error, a
    # rounded product leaves 0.
    w1, x1 = np.float32(0.1), np.float32(1 + 2.0**-7)  # x1 is a bf16 value; their product is not fp32
    product = np.float64(w1) * np.float64(x1)
    error = product - np.float64(np.float32(product))
    assert error != 0
    assert _combine_one_token([1.0, float(x1)], [-float(np.float32(product)), float(w1)]) == \
        np.float32(np.float32(error).astype(BF16))


@pytest.mark.parametrize("seed", range(3))
def test_combine_random_identity_experts_is_weighted_sum(seed):
    rng = np.random.default_rng(10 + seed)
    num_ranks, num_local_experts, num_topk, num_max_tokens, hidden = 4, 2, 5, 5, 256
    num_experts = num_ranks * num_local_experts
    num_tokens = rng.integers(0, num_max_tokens + 1, size=num_ranks)
    xs = [rng.standard_normal((t, hidden)).astype(BF16) for t in num_tokens]
    topk_idxs = [random_topk(rng, t, num_topk, num_experts) for t in num_tokens]
    weights = [rng.standard_normal((t, num_topk)).astype(np.float32) for t in num_tokens]
    results = [reference.dispatch(r, xs, topk_idxs, ones(num_ranks), num_max_tokens, num_experts, use_fp8=False)
               for r in range(num_ranks)]
    outs = [r.recv_x for r in results]
    for rank in range(num_ranks):
        combined, _ = reference.combine(rank, outs, results, topk_idxs[rank], weights[rank], ones(num_ranks))
        w = np.where(topk_idxs[rank] >= 0, weights[rank], 0).astype(np.float64)
        x = xs[rank].astype(np.float64)
        dense = w.sum(axis=1)[:, None] * x
        bound = BF16_REL_ERROR * np.abs(w).sum(axis=1)[:, None] * np.abs(x)
        assert np.all(np.abs(combined.astype(np.float64) - dense) <= bound)


def test_combine_leaves_out_experts_of_masked_ranks():
    results = [hand_dispatch(r, use_fp8=False) for r in range(2)]
    outs = scaled_expert_outs(results, 2)
    weights = [np.ones((3, 2), np.float32), np.ones((2, 2), np.float32)]
    # Rank 0 masks rank 1 in combine: only experts 0 and 1 count for rank 0's tokens. Rank 0 sends
    # rank 1 nothing either, so rank 1 times out on it, loses experts 0 and 1 and masks rank 0.
    actives = [np.array([1, 0], np.int32), np.array([1, 1], np.int32)]
    combined0, mask0 = reference.combine(0, outs, results, HAND_TOPK[0], weights[0], actives)
    np.testing.assert_array_equal(combined0[:, 0].astype(np.float32), [2 * 1, 1 * 2, 1 * 3])
    np.testing.assert_array_equal(mask0, [1, 0])
    combined1, mask1 = reference.combine(1, outs, results, HAND_TOPK[1], weights[1], actives)
    np.testing.assert_array_equal(combined1[:, 0].astype(np.float32), [3 * 11, 0])
    np.testing.assert_array_equal(mask1, [0, 1])


def test_combine_leaves_out_rank_that_did_not_run():
    results = [hand_dispatch(r, use_fp8=False) for r in range(2)]
    outs = scaled_expert_outs(results, 2)
    combined, mask = reference.combine(0, [outs[0], None], [results[0], None], HAND_TOPK[0],
                                       np.ones((3, 2), np.float32), ones(2))
    np.testing.assert_array_equal(combined[:, 0].astype(np.float32), [2, 2, 3])
    np.testing.assert_array_equal(mask, [1, 0])


def test_combine_leaves_out_experts_not_delivered_in_dispatch():
    actives = ones(2)
    actives[1] = np.array([0, 1], np.int32)  # rank 1 is cut off from rank 0 during dispatch
    xs = [origin_rows(0, 3, 128), origin_rows(1, 2, 128)]
    results = [reference.dispatch(r, xs, HAND_TOPK, actives, 3, 4, use_fp8=False) for r in range(2)]
    outs = scaled_expert_outs(results, 2)
    combined, _ = reference.combine(0, outs, results, HAND_TOPK[0], np.ones((3, 2), np.float32), ones(2))
    np.testing.assert_array_equal(combined[:, 0].astype(np.float32), [2, 2, 3])


@pytest.mark.parametrize("unnamed", [-1, 4, 99, -7])
def test_combine_leaves_out_entries_its_own_ids_name_no_expert(unnamed):
    """The kernels take the experts from combine's topk_idx, reading ids outside [0, E) as -1: such an
    entry adds nothing, even where the dispatch sent a row for it (the reference takes the rows
    from the dispatch)."""
    results = [hand_dispatch(r, use_fp8=False) for r in range(2)]
    outs = scaled_expert_outs(results, 2)
    ids = HAND_TOPK[0].copy()
    ids[0, 1] = unnamed  # token 0's second expert (expert 2, weight 0.25) unnamed in combine only
    weights = np.array([[0.5, 0.25], [4.0, 2.0], [1.0, 0.125]], np.float32)
    combined, _ = reference.combine(0, outs, results, ids, weights, ones(2))
    np.testing.assert_array_equal(combined[:, 0].astype(np.float32),
                                  [0.5 * 2 * 1, 2.0 * 1 * 2, 1.0 * 1 * 3 + 0.125 * 4 * 3])
    renormalized, _ = reference.combine(0, outs, results, ids, weights, ones(2), renormalize=True)
    np.testing.assert_array_equal(renormalized, combined)  # the unnamed weight is no weight: nothing to rescale


RENORM_TOPK = topk([[0, 2, -1], [2, 3, -1], [1, 3, 0]])
RENORM_WEIGHTS = np.array([[0.5, 0.25, 0.125], [0.5, 0.5, 4.0], [0.25, 0.5, 0.25]], np.float32)


def renorm_combine(actives, renormalize):
    xs = [np.ones((3, 128), BF16), np.ones((0, 128), BF16)]
    topk_idxs = [RENORM_TOPK, np.zeros((0, 3), np.int64)]
    results = [reference.dispatch(r, xs, topk_idxs, ones(2), 3, 4, use_fp8=False) for r in range(2)]
    outs = [r.recv_x for r in results]
    combined, _ = reference.combine(0, outs, results, RENORM_TOPK, RENORM_WEIGHTS, actives, renormalize=renormalize)
    return combined[:, 0].astype(np.float32)


def test_renormalize_rescales_live_weights_to_the_sum_of_valid_weights():
    cut = [np.array([1, 0], np.int32), np.array([0, 1], np.int32)]  # rank 0 loses experts 2 and 3
    # Token 0: valid weights 0.5 + 0.25 (the -1 entry's 0.125 is not a weight); live 0.5 -> x 1.5.
    # Token 1: every expert lost -> 0. Token 2: valid 1.0, live 0.25 + 0.25 -> x 2.
    np.testing.assert_array_equal(renorm_combine(cut, renormalize=False), [0.5, 0.0, 0.5])
    np.testing.assert_array_equal(renorm_combine(cut, renormalize=True), [0.75, 0.0, 1.0])
    # With nothing lost renormalize changes nothing.
    np.testing.assert_array_equal(renorm_combine(ones(2), renormalize=True), [0.75, 1.0, 1.0])
    np.testing.assert_array_equal(renorm_combine(ones(2), renormalize=False), [0.75, 1.0, 1.0])


def test_renormalize_keeps_live_weights_that_cancel_for_a_total_of_zero():
    """Weights (1, -1) sum to 0: nothing masked, renormalize has nothing to rescale and keeps them (a
    factor 0 had zeroed the token); masked to (1, -1) of a total 0.5, no factor reaches it: 0."""
    xs = [np.ones((2, 128), BF16), np.ones((0, 128), BF16)]
    ids = topk([[0, 1, -1], [0, 1, 2]])
    topk_idxs = [ids, np.zeros((0, 3), np.int64)]
    results = [reference.dispatch(r, xs, topk_idxs, ones(2), 2, 4, use_fp8=False) for r in range(2)]
    outs = [(r.recv_x.astype(np.float32) * np.array([1, 3], np.float32)[:, None, None] * (1 + 4 * rank)).astype(BF16)
            for rank, r in enumerate(results)]  # expert e's output: x * (1, 3, 5, 15)[e]
    weights = np.array([[1.0, -1.0, 0.0], [1.0, -1.0, 0.5]], np.float32)
    live, _ = reference.combine(0, outs, results, ids, weights, ones(2), renormalize=True)
    assert live[:, 0].astype(np.float32).tolist() == [1 - 3, 1 - 3 + 0.5 * 5]
    cut = [np.array([1, 0], np.int32), np.array([0, 1], np.int32)]  # rank 0 loses expert 2
    masked, _ = reference.combine(0, outs, results, ids, weights, cut, renormalize=True)
    assert masked[:, 0].astype(np.float32).tolist() == [1 - 3, 0]


def test_renormalize_random_weights_sum_is_preserved():
    rng = np.random.default_rng(20)
    num_ranks, num_local_experts, num_topk, num_tokens = 4, 2, 4, 6
    num_experts = num_ranks * num_local_experts
    xs = [np.ones((num_tokens, 128), BF16) for _ in range(num_ranks)]
    topk_idxs = [random_topk(rng, num_tokens, num_topk, num_experts) for _ in range(num_ranks)]
    weights = rng.uniform(0.1, 1.0, size=(num_tokens, num_topk)).astype(np.float32)
    results = [reference.dispatch(r, xs, topk_idxs, ones(num_ranks), num_tokens, num_experts, use_fp8=False)
               for r in range(num_ranks)]
    actives = ones(num_ranks)
    actives[0][3] = 0
    actives[3][0] = 0
    combined, _ = reference.combine(0, [r.recv_x for r in results], results, topk_idxs[0], weights, actives,
                                    renormalize=True)
    idx = topk_idxs[0]
    live = (idx >= 0) & (idx // num_local_experts != 3)
    total = np.where(idx >= 0, weights, 0).sum(axis=1)
    expected = np.where(live.any(axis=1), total, 0)
    np.testing.assert_allclose(combined[:, 0].astype(np.float32), expected, rtol=BF16_REL_ERROR)


def _fp32_nearest(exact: Fraction) -> np.float32:
    """``exact`` rounded to fp32, to nearest with ties to even (the oracle of _fmaf)."""
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.uint32)) & 1))


def test_combine_steps_round_once_like_fmaf():
    """An fp64 sum rounded to fp32 rounds twice: acc = 1 + 2^-8 plus w * y = 2^-24 (1 + 2^-30) lies just
    above an fp32 midpoint, which the fp64 sum lands on and the cast then rounds to even (down);
    fmaf, as ll_combine.cu uses, rounds up once, and bf16 keeps the difference."""
    w0, y0 = np.float32(1 + 2**-8), 1.0
    w1, y1 = np.float32(5237765 * 2.0**-47), 205 * 2.0**-7
    topk_idx = np.array([[0, 1]])
    x = np.zeros((1, 128), BF16)
    dispatched = reference.dispatch(0, [x], [topk_idx], [np.ones(1, np.int32)], 1, 2, use_fp8=False)
    out = np.zeros((2, 1, 128), BF16)
    out[0, 0], out[1, 0] = y0, y1
    combined, _ = reference.combine(0, [out], [dispatched], topk_idx, np.array([[w0, w1]], np.float32),
                                    [np.ones(1, np.int32)])
    want = _fp32_nearest(Fraction(float(w1)) * Fraction(y1) + Fraction(float(_fp32_nearest(Fraction(float(w0))))))
    assert float(want) == 1 + 2**-8 + 2**-23 and float(combined[0, 0]) == float(BF16.type(want)) == 1.0078125


def test_fmaf_is_correctly_rounded_over_wide_exponents():
    rng = np.random.default_rng(11)
    n = 3000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(BF16).astype(np.float32)
    c = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    c[::3] = -(a[::3].astype(np.float64) * b[::3]).astype(np.float32)  # near cancellation
    got = reference._fmaf(a, b, c)
    for i in range(n):
        want = _fp32_nearest(Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i])))
        assert got[i] == want, (i, a[i], b[i], c[i], got[i], want)


def test_fmaf_of_infinities_and_overflow_is_quiet():
    """inf - inf in the rounding's error term: NaN, left out without a warning (numpy's warnings as
    errors had made combine raise on expert outputs holding inf)."""
    a = np.array([1, 1, 3e38, 2, 1], np.float32)
    b = np.array([np.inf, -np.inf, 3e38, np.nan, 1], np.float32)
    c = np.array([1, np.inf, 0, 0, np.float32(3.4e38)], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = reference._fmaf(a, b, c)
    np.testing.assert_array_equal(got, np.array([np.inf, np.nan, np.inf, np.nan, np.float32(3.4e38)], np.float32))


def test_renormalize_sums_weights_in_the_kernels_butterfly_order():
    """warp_sum adds lanes k and k ^ 16, then ^ 8, ^ 4, ^ 2, ^ 1, and fp32 sums depend on the order:
    here (1 + -1) meets the two 2^-24 only after they have met each other (2^-23), where adding left
    to right loses both to 1's rounding (0)."""
    weights = np.array([[1.0, 2**-24, 2**-24, 0, 0, 0, 0, 0, -1.0]], np.float32)
    left_to_right = np.float32(0)
    for w in weights[0]:
        left_to_right = np.float32(left_to_right + w)
    assert left_to_right == 0
    assert reference._warp_sum(weights).tolist() == [2**-23]


def test_dispatch_reads_ids_outside_the_experts_as_none():
    """As the kernels' read_expert does (device ids are not checked), and as combine already did: an id
    below -1 or at least E sends nothing; it had raised IndexError."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 128)).astype(BF16)
    ids = np.array([[0, 4], [1, -7], [9, 2]])
    cleaned = np.where((ids >= 0) & (ids < 4), ids, -1)
    got = reference.dispatch(0, [x], [ids], [np.ones(1, np.int32)], 3, 4, use_fp8=False)
    want = reference.dispatch(0, [x], [cleaned], [np.ones(1, np.int32)], 3, 4, use_fp8=False)
    for field in ("recv_x", "recv_count", "recv_src_rank", "recv_src_token", "recv_src_topk"):
        np.testing.assert_array_equal(getattr(got, field).view(np.uint8), getattr(want, field).view(np.uint8))
    assert want.recv_count.tolist() == [1, 1, 1, 0]
