"""A Mixture-of-Experts layer in JAX on mooncake_ep: router, dispatch, per-expert matmul, combine.

Every rank routes its bf16 tokens with a softmax router (top-k, weights renormalised to sum to 1),
dispatches them with :func:`mooncake_ep.jax.dispatch`, multiplies the rows each of its local experts
received by that expert's matrix (``jax.numpy``), and combines. The layer is checked against the same
layer computed densely in float32 (every token through its top-k experts, same weights), and, with
``--train``, so is its gradient (w.r.t. the tokens, the router and the experts).

Two ways to place the ranks:

- ``shard_map`` (default): one rank per JAX device, the whole layer one ``jax.jit`` program under
  ``jax.shard_map``; the ops run on each device's own stream.
- ``split``: all ranks in one program on one device (several ranks on one GPU, whose work XLA runs on
  one stream): every rank's send half, then every rank's receive half.

Run ``python examples/jax_moe.py --help``. On a machine without a GPU the ranks are JAX CPU devices
on the numpy reference backend (``--ranks`` of them; the script asks JAX for that many). The exit code
is 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

# Relative error the layer may show, for its worst token (norm of the difference over the dense
# result's, per token; per expert for the experts' gradient): the bf16 roundings of recv_x, of the
# expert outputs and of the combined sum give about 2**-8; a misrouted or dropped token costs that
# token O(1 / top-k). (One norm over every token would dilute a lost token by the square root of
# the token count: 1024 tokens hide a zeroed one under 2e-2.)
TOLERANCE = 2e-2


def init_params(seed: int, hidden: int, num_experts: int) -> dict:
    """Router ``[hidden, num_experts]`` and expert matrices ``[num_experts, hidden, hidden]``, float32."""
    rng = np.random.default_rng(seed)
    return {
        "router": (rng.standard_normal((hidden, num_experts)) / np.sqrt(hidden)).astype(np.float32),
        "experts": (rng.standard_normal((num_experts, hidden, hidden)) / np.sqrt(hidden)).astype(np.float32),
    }


def route(router, x, num_topk: int):
    """Softmax router: ``(topk_idx [t, K] int32, topk_weights [t, K] float32)``, weights summing to 1."""
    import jax
    import jax.numpy as jnp

    probs = jax.nn.softmax(x.astype(jnp.float32) @ router, axis=-1)
    weights, topk_idx = jax.lax.top_k(probs, num_topk)
    return topk_idx.astype(jnp.int32), weights / jnp.sum(weights, axis=-1, keepdims=True)


def experts_apply(local_experts, recv_x, recv_count):
    """Each local expert's matrix on the rows it received: ``[E_l, rows, H]`` bf16 -> bf16.

    Rows past ``recv_count[e]`` hold whatever the workspace had (NaN included): they are zeroed on
    the way in and out, or the experts' gradient (a sum over every row) would pick them up.
    """
    import jax.numpy as jnp

    received = (jnp.arange(recv_x.shape[1])[None, :] < recv_count[:, None])[..., None]
    x = jnp.where(received, recv_x.astype(jnp.float32), 0.0)
    return jnp.where(received, jnp.einsum("erh,ehk->erk", x, local_experts), 0.0).astype(jnp.bfloat16)


def moe_layer(buffer, grad_buffer, params_local, x, active, *, num_max_tokens: int, num_experts: int,
              num_topk: int):
    """One rank's MoE layer (inside shard_map): ``(out [t, H] bf16, active_ranks)``."""
    import mooncake_ep.jax as epj

    topk_idx, weights = route(params_local["router"], x, num_topk)
    recv_x, recv_count, handle, active = epj.dispatch(buffer, x, topk_idx, active, num_max_tokens, num_experts,
                                                      use_fp8=False)
    y = experts_apply(params_local["experts"], recv_x, recv_count)
    return epj.combine(buffer, y, topk_idx, weights, active, handle, grad_buffer=grad_buffer)


def dense_layer(params, x, num_topk: int):
    """The same layer without communication, in float32: ``[tokens, H]``."""
    import jax.numpy as jnp

    topk_idx, weights = route(params["router"], x, num_topk)
    # Every expert on every token, then each token's picks: [t, E, H] (gathering each token's K
    # matrices, [t, K, H, H], held H / E times as much).
    ys = jnp.einsum("th,ehj->tej", x.astype(jnp.float32), params["experts"])
    picked = jnp.take_along_axis(ys, topk_idx[:, :, None], axis=1)  # [t, K, H]
    return jnp.sum(weights[:, :, None] * picked, axis=1)


def loss_of(out):
    import jax.numpy as jnp

    return jnp.mean(out.astype(jnp.float32) ** 2)


def run_shard_map(devices, params, tokens, *, num_max_tokens: int, num_topk: int, train: bool) -> dict:
    """The layer (and its gradient with ``train``) with one rank per device; returns host arrays."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import mooncake_ep as ep
    import mooncake_ep.jax as epj

    num_ranks, (num_experts, hidden) = len(devices), params["experts"].shape[:2]
    buffers = epj.make_buffers(devices, ep.Buffer.get_ep_buffer_size_hint(num_max_tokens, hidden, num_ranks,
                                                                           num_experts))
    grad_buffers = epj.make_buffers(devices, epj.grad_buffer_size_hint(num_max_tokens, hidden, num_ranks,
                                                                       num_experts, num_topk)) if train else None
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    layer = functools.partial(moe_layer, buffers, grad_buffers, num_max_tokens=num_max_tokens,
                              num_experts=num_experts, num_topk=num_topk)
    param_specs = {"router": P(), "experts": P("ep")}

    def forward(params, x, active):
        out, _ = layer(params, x, active)
        return out

    def step(params, x, active):
        if not train:
            return forward(params, x, active), None
        # The mean over all tokens: each rank's share, summed over ranks (psum) by the gradient's transpose.
        def local_loss(params, x):
            return loss_of(forward(params, x, active)) / num_ranks
        out = forward(params, x, active)
        grads = jax.grad(local_loss, argnums=(0, 1))(params, x)
        return out, grads

    out_specs = (P("ep"), ({"router": P(), "experts": P("ep")}, P("ep")) if train else None)
    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(param_specs, P("ep"), P("ep")), out_specs=out_specs))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    active = np.ones(num_ranks * num_ranks, np.int32)
    out, grads = sharded({k: put(v, param_specs[k]) for k, v in params.items()}, put(tokens, P("ep")),
                         put(active, P("ep")))
    result = {"out": np.asarray(out, np.float32)}
    if train:
        # The replicated router's gradient is summed over the ranks by shard_map (it is invariant across
        # "ep"); the experts' gradients gather every rank's tokens through combine's backward.
        result["grads"] = {"router": np.asarray(grads[0]["router"], np.float32),
                           "experts": np.asarray(grads[0]["experts"], np.float32), "x": np.asarray(grads[1], np.float32)}
    epj.destroy_buffers(buffers)
    if grad_buffers is not None:
        epj.destroy_buffers(grad_buffers)
    return result


def run_split(device, num_ranks: int, params, tokens, *, num_max_tokens: int, num_topk: int) -> dict:
    """The layer with ``num_ranks`` ranks in one program on ``device`` (the split form)."""
    import jax
    import jax.numpy as jnp

    import mooncake_ep as ep
    import mooncake_ep.jax as epj

    num_experts, hidden = params["experts"].shape[:2]
    num_local = num_experts // num_ranks
    on_gpu = device.platform != "cpu"
    group = ep.LocalGroup(num_ranks, devices=[device.local_hardware_id] * num_ranks if on_gpu else None)
    size = ep.Buffer.get_ep_buffer_size_hint(num_max_tokens, hidden, num_ranks, num_experts)
    buffers = group.spawn(lambda g: ep.Buffer(g, size, backend="cuda" if on_gpu else "reference"))

    @jax.jit
    def step(params, xs, actives):
        routes = [route(params["router"], x, num_topk) for x in xs]
        sent = [epj.dispatch_send(buffers[r], xs[r], routes[r][0], actives[r], num_max_tokens, num_experts,
                                  use_fp8=False) for r in range(num_ranks)]
        received = epj.dispatch_recv(sent)
        sent = [epj.combine_send(buffers[r], experts_apply(params["experts"][r * num_local:(r + 1) * num_local], recv,
                                                           count), routes[r][0], routes[r][1], active, handle)
                for r, (recv, count, handle, active) in enumerate(received)]
        return jnp.concatenate([out for out, _ in epj.combine_recv(sent)])

    with jax.default_device(device):
        xs = np.split(tokens, num_ranks)
        out = step(jax.tree_util.tree_map(jnp.asarray, params), [jnp.asarray(x) for x in xs],
                   [jnp.ones(num_ranks, jnp.int32)] * num_ranks)
        out = np.asarray(out, np.float32)
    group.spawn(lambda g: buffers[g.rank].destroy())
    return {"out": out}


def relative_error(got: np.ndarray, want: np.ndarray, *, per_row: bool = True) -> float:
    """The largest relative error of a row (a token; an expert's matrix for ``[E, H, H]``), or of
    the whole array."""
    rows = got.shape[0] if per_row else 1
    got, want = (np.asarray(a, np.float64).reshape(rows, -1) for a in (got, want))
    error = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-30)
    return float(error.max(initial=0.0))


def check(result: dict, params, tokens, num_topk: int, tolerance: float = TOLERANCE) -> dict:
    """The worst token's relative error of the layer (and of its gradients: per token, per expert,
    and the router's as one; at top-1, where the router's is zero, its size) against the dense
    float32 layer."""
    import jax
    import jax.numpy as jnp

    jparams = jax.tree_util.tree_map(jnp.asarray, params)
    x = jnp.asarray(tokens)
    errors = {"out": relative_error(result["out"], np.asarray(dense_layer(jparams, x, num_topk)))}
    if "grads" in result:
        dense_grads = jax.grad(lambda p, x: loss_of(dense_layer(p, x, num_topk)), argnums=(0, 1))(jparams, x)
        errors["grad x"] = relative_error(result["grads"]["x"], np.asarray(dense_grads[1], np.float32))
        errors["grad experts"] = relative_error(result["grads"]["experts"], np.asarray(dense_grads[0]["experts"]))
        if num_topk > 1:
            errors["grad router"] = relative_error(result["grads"]["router"], np.asarray(dense_grads[0]["router"]),
                                                   per_row=False)
        else:
            # One expert's renormalised weight is 1: the loss does not depend on the router, whose
            # gradient is zero, and both sides hold only float32 noise (a relative error of noise
            # over noise means nothing). Its size over the experts' gradient's stands in.
            errors["grad router"] = float(np.linalg.norm(result["grads"]["router"])
                                          / np.linalg.norm(np.asarray(dense_grads[0]["experts"])))
    errors["ok"] = all(v <= tolerance for k, v in errors.items() if k != "ok")
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=("shard_map", "split"), default="shard_map")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks (shard_map: at most the devices, default all GPUs or 4 CPU devices; split: 4)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per rank (= num_max_dispatch_tokens_per_rank)")
    parser.add_argument("--hidden", type=int, default=256, help="a multiple of 128")
    parser.add_argument("--experts", type=int, default=8, help="a multiple of --ranks")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--train", action="store_true", help="also check the gradient (shard_map mode)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train and args.mode == "split":
        parser.error("--train checks gradients through shard_map; the split form is not differentiable")
    for name in ("ranks", "tokens", "hidden", "experts", "topk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if args.topk > args.experts:
        parser.error(f"--topk ({args.topk}) must be <= --experts ({args.experts})")
    if args.topk > 16:  # mooncake_ep's most, as DeepEP's low-latency kernels
        parser.error(f"--topk must be <= 16, got {args.topk}")
    if args.seed < 0:  # numpy's generators take none
        parser.error(f"--seed must be >= 0, got {args.seed}")

    import jax

    # CPU ranks need a device each; this only takes effect before JAX starts, and only on the CPU.
    try:
        jax.config.update("jax_num_cpu_devices", 4 if args.ranks is None else args.ranks)
    except RuntimeError:  # JAX already started (main called from a program that used it): keep its devices
        pass
    gpus = [d for d in jax.devices() if d.platform != "cpu"]
    devices = gpus or jax.devices("cpu")
    ranks = args.ranks
    if ranks is None:
        ranks = 4 if args.mode == "split" else len(gpus) or min(4, len(devices))
    import mooncake_ep as ep

    from mooncake_ep.cli import UsageError, check_host_memory

    try:  # the library's own checks of the shape (hidden a multiple of 128, experts of ranks, ...)
        workspace_bytes = ep.Buffer.get_ep_buffer_size_hint(args.tokens, args.hidden, ranks, args.experts)
        if not gpus:  # CPU ranks: what does not fit fails deep inside XLA
            dense_bytes = ranks * args.tokens * args.experts * args.hidden * 4  # dense_layer's [t, E, H] fp32
            check_host_memory(f"{ranks} CPU ranks' workspaces and the dense check",
                              ranks * workspace_bytes + dense_bytes, "--tokens, --hidden or --experts")
    except (ValueError, UsageError) as exc:
        parser.error(str(exc).replace("get_ep_buffer_size_hint: ", ""))
    params = init_params(args.seed, args.hidden, args.experts)
    from mooncake_ep.reference import bfloat16

    tokens = np.random.default_rng(args.seed + 1).standard_normal((ranks * args.tokens, args.hidden)).astype(bfloat16)
    if args.mode == "shard_map":
        if ranks > len(devices):
            parser.error(f"--ranks {ranks} needs {ranks} devices, JAX has {len(devices)}; use --mode split")
        result = run_shard_map(devices[:ranks], params, tokens, num_max_tokens=args.tokens, num_topk=args.topk,
                               train=args.train)
    else:
        result = run_split(devices[0], ranks, params, tokens, num_max_tokens=args.tokens, num_topk=args.topk)
    errors = check(result, params, tokens, args.topk)
    backend = "kernels" if gpus else "numpy reference"
    print(f"{args.mode}: {ranks} ranks on {devices[0].platform} ({backend}), {args.tokens} tokens each, "
          f"hidden {args.hidden}, {args.experts} experts, top-{args.topk}")
    print("  worst relative error against the dense float32 layer"
          + (" (the router's gradient, zero at top-1: its size over the experts')" if args.topk == 1 else ""))
    for name, value in errors.items():
        if name != "ok":
            print(f"  {name}: {value:.2e} (tolerance {TOLERANCE:.0e})")
    print("passed" if errors["ok"] else "FAILED")
    return 0 if errors["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
