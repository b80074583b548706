"""examples/jax_moe.py: the JAX MoE layer (and its gradient) against the dense layer.

On the CPU the ranks are JAX CPU devices on the numpy reference (tests/conftest.py gives JAX several);
on a GPU the same functions run the kernels: shard_map over the visible GPUs, and the split form
with four ranks on GPU 0.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "jax_moe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("jax_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(example, num_ranks: int, tokens: int = 8, hidden: int = 256, experts: int = 8):
    from mooncake_ep.reference import bfloat16

    params = example.init_params(0, hidden, experts)
    x = np.random.default_rng(1).standard_normal((num_ranks * tokens, hidden)).astype(bfloat16)
    return params, x


def gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def assert_close(errors: dict, tolerance: float) -> None:
    assert errors["ok"], f"relative errors above {tolerance}: {errors}"
    # A layer that dropped or misrouted tokens would be off by O(1/top-k); these are bf16 roundings.
    assert all(v < tolerance for k, v in errors.items() if k != "ok"), errors


# top-1: the router's gradient is zero (weights renormalised to 1) whatever combine's weight gradient is, so
# there only the output, x and the experts are really compared; top-2 checks the weight gradient.
@pytest.mark.parametrize("num_topk", [2, 1])
def test_shard_map_layer_and_gradient_match_the_dense_layer_on_the_cpu(num_topk):
    example = load_example()
    devices = jax.devices("cpu")[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 JAX CPU devices")
    params, x = inputs(example, 4)
    result = example.run_shard_map(devices, params, x, num_max_tokens=8, num_topk=num_topk, train=True)
    errors = example.check(result, params, x, num_topk)
    assert set(errors) == {"out", "grad x", "grad experts", "grad router", "ok"}
    assert_close(errors, example.TOLERANCE)


def test_split_layer_matches_the_dense_layer_on_the_cpu():
    example = load_example()
    params, x = inputs(example, 4)
    result = example.run_split(jax.devices("cpu")[0], 4, params, x, num_max_tokens=8, num_topk=2)
    assert_close(example.check(result, params, x, 2), example.TOLERANCE)


@pytest.mark.parametrize("num_ranks", [1, 128], ids=["8-tokens", "1024-tokens"])
def test_a_wrong_layer_fails_the_check(num_ranks):
    """The check is not vacuous: a layer that loses one token, or one expert's share of one token,
    fails it, also among 1024 tokens (one norm over them all had diluted that token under 2e-2)."""
    example = load_example()
    params, x = inputs(example, num_ranks)
    jparams = jax.tree_util.tree_map(jax.numpy.asarray, params)
    dense = np.asarray(example.dense_layer(jparams, jax.numpy.asarray(x), 2))
    assert example.check({"out": dense}, params, x, 2)["ok"]
    broken = dense.copy()
    broken[0] = 0
    assert not example.check({"out": broken}, params, x, 2)["ok"]
    one_expert = np.asarray(example.dense_layer(jparams, jax.numpy.asarray(x[:1]), 1))  # token 0's first expert
    weights = np.asarray(example.route(jparams["router"], jax.numpy.asarray(x[:1]), 2)[1])
    broken = dense.copy()
    broken[0] -= weights[0, 0] * one_expert[0]  # its first expert's term left out
    assert not example.check({"out": broken}, params, x, 2)["ok"]


def test_the_script_runs(capsys):
    example = load_example()
    assert example.main(["--mode", "split", "--ranks", "2", "--tokens", "4", "--hidden", "128", "--experts", "4"]) == 0
    assert "passed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # the split form has no gradient to check
        example.main(["--mode", "split", "--train"])
    assert refused.value.code == 2 and "--train checks gradients through shard_map" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),  # had run 4 ranks
    (["--ranks", "-1"], "--ranks must be >= 1, got -1"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--topk", "9"], "--topk (9) must be <= --experts (8)"),
    (["--hidden", "100"], "hidden must be a multiple of 128, got 100"),
    (["--mode", "split", "--ranks", "3"], "num_experts must be a multiple of num_ranks=3, got 8"),
    (["--topk", "17", "--experts", "32"], "--topk must be <= 16, got 17"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as refused:
        load_example().main(argv)
    assert refused.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="needs a CUDA GPU visible to JAX")
def test_shard_map_layer_and_gradient_on_the_gpus():
    example = load_example()
    devices = gpus()
    params, x = inputs(example, len(devices), experts=8 * len(devices))
    result = example.run_shard_map(devices, params, x, num_max_tokens=8, num_topk=2, train=True)
    assert_close(example.check(result, params, x, 2), example.TOLERANCE)


@pytest.mark.gpu
@pytest.mark.skipif(not gpus(), reason="needs a CUDA GPU visible to JAX")
def test_split_layer_with_four_ranks_on_one_gpu():
    example = load_example()
    params, x = inputs(example, 4)
    result = example.run_split(gpus()[0], 4, params, x, num_max_tokens=8, num_topk=2)
    assert_close(example.check(result, params, x, 2), example.TOLERANCE)
