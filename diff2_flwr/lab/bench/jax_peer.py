"""The JAX side of ``diff2 bench``'s ``jax_peer`` section: what an engineer would write in JAX
instead of the batched engine, on the same work (the paper MLP, ½-squared error, full-batch DP-GD
and DIFF2 rounds, K runs).

It reproduces the reviewers' benchmark ``shared/bench/jax_peer.py`` (its maths and its three
variants); the driver, the cells and the bookkeeping are the project's, in
:mod:`diff2_flwr.lab.bench.jax_cells`. Variants:

- ``vmap``: ``jax.vmap(jax.grad)`` per-sample gradients (DIFF2: at both iterates), clipped and
  averaged;
- ``ghost``: closed-form per-sample norms and clipped sums of the one-hidden-layer MLP, no
  per-sample gradient materialised, samples innermost; DIFF2 keeps the previous iterate's forward
  quantities (one forward pass a round); the K runs by an outer ``vmap``;
- ``ghost_map``: the same, the K runs one after another by ``lax.map`` inside one program (each
  run's intermediates stay in cache); K > 1 only.

Why a module of its own, loaded by file: it runs in the user's JAX interpreter (often a venv of its
own, with jax and numpy but neither torch nor this package), as a subprocess serving pickled
requests on stdin/stdout. So it imports nothing of the package, only the standard library, numpy and
(lazily) jax; it lives in ``lab/`` rather than ``benchmarks/`` because the installed package carries
``lab/`` and ``diff2 bench`` must find it there.

Protocol (one pickled tuple per request, one pickled reply each):
``("setup", A [P, N, F], Y [P, N], mask [P, N], sizes, hidden)`` -> versions and affinity;
``("build", name, kind, variant, dtype, specs, x0)`` -> compile seconds (AOT, excluded from timing);
``("run", name, rounds, zero_noise)`` -> seconds of the timed loop and the final iterates [K, d];
``("clipped_fraction", name)`` -> the share of real samples the clip binds on in the checked round
(run 0); ``("clipping", x, xp, A_rows, Y_rows, radii, dtype)`` -> the peer's clip factors of those
rows at those radii and the rows' factors (for the under-clipping check of
:func:`diff2_flwr.lab.bench.jax_cells.clipping_check`); ``("quit",)``.

References:
    Murata & Suzuki (2023), DIFF2 (Algorithms 1-2) and DP-GD; Goodfellow (2015) and Li et al. (2022)
    for per-sample norms without per-sample gradients ("ghost clipping").
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any

import numpy as np

__all__ = ["JaxCell", "build_maths", "serve"]

XLA_ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def build_maths(jax: Any, jnp: Any, A: np.ndarray, Y: np.ndarray, mask: np.ndarray,
                sizes: list[int], hidden: int) -> dict[str, Any]:
    """The JAX round functions and the data in float32 and float64.

    Args:
        jax, jnp: the jax modules (x64 enabled).
        A, Y, mask: the project's padded shards [P, N, F], [P, N], [P, N] (client p's samples at
            m = p·N + n).
        sizes: the shard sizes n_p.
        hidden: the hidden width H; x = (W1 [H, F], b1, W2 [1, H], b2), nn.Linear's parameter order.
    """
    P, N, F = A.shape
    H, D = hidden, hidden * F + 2 * hidden + 1
    n = np.asarray(sizes, np.float64)
    flat = A.reshape(-1, F)
    data = {}
    for name, dt in (("f32", jnp.float32), ("f64", jnp.float64)):
        data[name] = {"A": jnp.asarray(flat, dt), "AT": jnp.asarray(flat.T.copy(), dt),
                      "Y": jnp.asarray(Y.reshape(-1), dt), "mask": jnp.asarray(mask.reshape(-1),
                                                                               dt),
                      "inv_n": jnp.asarray(1.0 / n, dt),
                      "sqA1": jnp.asarray((flat ** 2).sum(1) + 1.0, dt),
                      "w": jnp.asarray((mask / (P * n)[:, None]).reshape(-1), dt)}

    def unpack(x):
        return x[:H * F].reshape(H, F), x[H * F:H * F + H], x[H * F + H:H * F + 2 * H], x[D - 1]

    def clip_factors(sq, radius, m):
        """radius / ||g|| where ||g|| > radius, else 1 (the project's rule), times the padding
        mask."""
        nrm = jnp.sqrt(sq)
        over = nrm > radius
        return jnp.where(over, radius / jnp.where(over, nrm, 1.0), 1.0) * m

    # ---- vmap(grad): per-sample gradients [M, D]
    def sample_loss(x, a, y):
        W1, b1, w2, b2 = unpack(x)
        z = w2 @ jax.nn.softplus(W1 @ a + b1) + b2
        return 0.5 * (z - y) ** 2

    psg = jax.vmap(jax.grad(sample_loss), in_axes=(None, 0, 0))

    def vm_clipped_mean(G, radius, Dd):
        c = clip_factors((G * G).sum(1), radius, Dd["mask"])
        S = jnp.einsum("pn,pnd->pd", c.reshape(P, N), G.reshape(P, N, D))
        return (S * Dd["inv_n"][:, None]).mean(0)

    def vm_mean(x, C, Dd):
        return vm_clipped_mean(psg(x, Dd["A"], Dd["Y"]), C, Dd), ()

    def vm_diff_mean(x, xp, prev, radius, Dd):
        return vm_clipped_mean(psg(x, Dd["A"], Dd["Y"]) - psg(xp, Dd["A"], Dd["Y"]), radius, Dd), ()

    # ---- ghost: closed-form norms and clipped sums, samples innermost ([H, M], the project's
    # layout)
    def parts(x, Dd):
        W1, b1, w2, b2 = unpack(x)
        h = W1 @ Dd["AT"] + b1[:, None]
        t = jnp.exp(-jnp.abs(h))
        s = jnp.maximum(h, 0) + jnp.log1p(t)  # softplus
        dphi = jnp.where(h >= 0, 1.0, t) / (1 + t)  # its derivative, from the same exp
        e = w2 @ s + b2 - Dd["Y"]  # residual [M]
        return s, e, w2[:, None] * dphi * e  # delta = dℓ/dh [H, M]

    def ghost_sums(c, dd, u, de, Dd):
        """Σ_i w_i (dd_i ⊗ a_i, dd_i, u_i, de_i), w_i = c_i / (P n_p(i)): the average over clients
        of their clipped means folded into one weight per sample."""
        w = c * Dd["w"]
        cd = dd * w
        return jnp.concatenate([(cd @ Dd["A"]).reshape(-1), cd.sum(1), u @ w, (de * w).sum()[None]])

    def ghost_sq(x, Dd):
        s, e, delta = parts(x, Dd)
        return (delta * delta).sum(0) * Dd["sqA1"] + e * e * (1 + (s * s).sum(0)), (s, e, delta)

    def gh_mean(x, C, Dd):
        sq, (s, e, delta) = ghost_sq(x, Dd)
        return ghost_sums(clip_factors(sq, C, Dd["mask"]), delta, s * e, e, Dd), (s, e, delta)

    def diff_sq(x, prev, Dd):
        s, e, delta = parts(x, Dd)
        sp, ep, deltap = prev
        dd, u, de = delta - deltap, s * e - sp * ep, e - ep
        return (dd * dd).sum(0) * Dd["sqA1"] + (u * u).sum(0) + de * de, (dd, u, de), (s, e, delta)

    def gh_diff_mean(x, xp, prev, radius, Dd):
        sq, (dd, u, de), now = diff_sq(x, prev, Dd)
        return ghost_sums(clip_factors(sq, radius, Dd["mask"]), dd, u, de, Dd), now

    means = {"vmap": (vm_mean, vm_diff_mean), "ghost": (gh_mean, gh_diff_mean)}

    def noise(key, std, dt):
        key, sub = jax.random.split(key)
        return key, std * jax.random.normal(sub, (D,), dt)

    def dpgd_round(variant):
        mean_fn = means[variant][0]

        def step(x, key, hp, Dd):
            lr, C, sig = hp
            key, xi = noise(key, sig * C, x.dtype)
            return x - lr * (mean_fn(x, C, Dd)[0] + xi), key
        return step

    def restart_round(variant):  # DIFF2's restart: v = mean + noise
        mean_fn = means[variant][0]

        def step(x, key, hp, Dd):
            lr, C1, sig1 = hp
            mean, pr = mean_fn(x, C1, Dd)
            key, xi = noise(key, sig1 * C1, x.dtype)
            v = mean + xi
            return x - lr * v, x, v, key, pr
        return step

    # v_r = v_{r-1} + mean of clipped differences + noise, radius C2 ||x - xp||
    def diff_round(variant):
        diff_fn = means[variant][1]

        def step(x, xp, v, key, pr, hp, Dd):
            lr, C2, sig2 = hp
            radius = C2 * jnp.sqrt(jnp.sum((x - xp) ** 2))
            mean, pr = diff_fn(x, xp, pr, radius, Dd)
            key, xi = noise(key, sig2 * radius, x.dtype)
            v = v + mean + xi
            return x - lr * v, x, v, key, pr
        return step

    def clipped_fraction(x, xp, radius):
        """Share of real samples whose (difference) gradient norm exceeds ``radius`` (float64; xp
        None: DP-GD)."""
        Dd = data["f64"]
        if xp is None:
            sq = ghost_sq(x, Dd)[0]
        else:
            sq = diff_sq(x, parts(xp, Dd), Dd)[0]
        return float(((jnp.sqrt(sq) > radius) * Dd["mask"]).sum() / Dd["mask"].sum())

    def clipping_of(x, xp, A_rows, Y_rows, radii, dtype):
        """The peer's clipping of the rows (features ``A_rows`` [M, F], targets ``Y_rows`` [M]) at
        x (xp None: plain gradients) or of the differences between x and xp, in ``dtype``, at each
        radius vector of ``radii`` [V, M]: its clip factors [V, M] and the row's factors, all as
        float64 numbers (exact copies of the dtype's): the row is (dd ⊗ a, dd, u, de)."""
        dt = {"f32": jnp.float32, "f64": jnp.float64}[dtype]
        Dd = {"AT": jnp.asarray(A_rows.T.copy(), dt), "Y": jnp.asarray(Y_rows, dt),
              "sqA1": jnp.asarray((A_rows ** 2).sum(1) + 1.0, dt)}
        xj = jnp.asarray(x, dt)
        if xp is None:
            sq, (s, e, delta) = ghost_sq(xj, Dd)
            dd, u, de = delta, s * e, e
        else:
            sq, (dd, u, de), _ = diff_sq(xj, parts(jnp.asarray(xp, dt), Dd), Dd)
        ones = jnp.ones(A_rows.shape[0], dt)
        c = [np.asarray(clip_factors(sq, jnp.asarray(r, dt), ones), np.float64) for r in radii]
        a = np.asarray(jnp.asarray(A_rows, dt), np.float64)
        return {"c": np.stack(c), "dd": np.asarray(dd, np.float64), "u": np.asarray(u, np.float64),
                "de": np.asarray(de, np.float64), "a": a,
                "norm": np.asarray(jnp.sqrt(sq), np.float64)}

    return {"data": data, "dpgd_round": dpgd_round, "restart_round": restart_round,
            "diff_round": diff_round,
            "clipped_fraction": clipped_fraction, "clipping_of": clipping_of, "D": D}


class JaxCell:
    """One (kind, variant, dtype) over K runs: the round functions compiled ahead of time (seconds
    kept), and :meth:`run` timing R rounds.

    Args:
        jax, jnp: the jax modules.
        maths: :func:`build_maths`' result.
        kind: ``"dpgd"`` or ``"diff2"`` (one restart round, then difference rounds).
        variant: ``"vmap"``, ``"ghost"`` or ``"ghost_map"``.
        dtype: ``"f32"`` or ``"f64"``.
        specs: K tuples (restart_every, learning_rate, clip_restart, clip_diff, sigma_restart,
            sigma_diff, noise_seed, init_seed), the project's RunSpec fields.
        x0: the K initial iterates [K, d] (float64), the project's.
    """

    def __init__(self, jax: Any, jnp: Any, maths: dict[str, Any], kind: str, variant: str,
                 dtype: str, specs: list[tuple], x0: np.ndarray) -> None:
        dt = {"f32": jnp.float32, "f64": jnp.float64}[dtype]
        self.kind, self.K, self.maths, self.Dd = kind, len(specs), maths, maths["data"][dtype]
        mapped, base = variant.endswith("_map"), variant.removesuffix("_map")
        if mapped and self.K == 1:
            raise ValueError(
                f"Variant {variant!r} maps over the K runs; K = 1 has nothing to map (use "
                f"'ghost').")
        col = lambda i: jnp.asarray([s[i] for s in specs], dt)  # noqa: E731
        self.x0 = jnp.asarray(x0, dt)
        self.keys = jnp.stack([jax.random.PRNGKey(1000 + int(s[6])) for s in specs])
        self.hp1 = (col(1), col(2), col(4))  # restart / DP-GD: (lr, C1, σ1)
        self.hp = (col(1), col(3), col(5))  # difference rounds: (lr, C2, σ2)
        if self.K == 1:  # the unbatched functions
            self.x0, self.keys = self.x0[0], self.keys[0]
            self.hp1, self.hp = tuple(h[0] for h in self.hp1), tuple(h[0] for h in self.hp)

        def batched(f, n_state):
            if self.K == 1:
                return f
            if not mapped:
                return jax.vmap(f, in_axes=(0,) * n_state + (0, None))

            def over_runs(*args):  # one run after another inside one program
                return jax.lax.map(lambda a: f(*a, args[-1]), tuple(args[:-1]))
            return over_runs

        self.compile_s: dict[str, float] = {}
        t = time.perf_counter()
        if kind == "dpgd":
            self.step = jax.jit(batched(maths["dpgd_round"](base), 2)).lower(self.x0, self.keys,
                                                                             self.hp1,
                                                                               self.Dd).compile()
            self.compile_s["round"] = time.perf_counter() - t
            return
        restart = jax.jit(batched(maths["restart_round"](base), 2))
        self.restart = restart.lower(self.x0, self.keys, self.hp1, self.Dd).compile()
        self.compile_s["restart"] = time.perf_counter() - t
        t = time.perf_counter()
        shapes = jax.eval_shape(restart, self.x0, self.keys, self.hp1, self.Dd)
        self.diff = jax.jit(batched(maths["diff_round"](base), 5)).lower(*shapes, self.hp,
                                                                         self.Dd).compile()
        self.compile_s["diff"] = time.perf_counter() - t

    def run(self, rounds: int, zero_noise: bool = False) -> tuple[float, np.ndarray]:
        """Seconds of ``rounds`` rounds from x_0 (ready results included) and the final iterates [K,
        d]."""
        hp1, hp = self.hp1, self.hp
        if zero_noise:
            hp1, hp = hp1[:2] + (hp1[2] * 0,), hp[:2] + (hp[2] * 0,)
        t = time.perf_counter()
        x, key = self.x0, self.keys
        if self.kind == "dpgd":
            for _ in range(rounds):
                x, key = self.step(x, key, hp1, self.Dd)
        else:
            state = self.restart(x, key, hp1, self.Dd)
            for _ in range(rounds - 1):
                state = self.diff(*state, hp, self.Dd)
            x = state[0]
        x.block_until_ready()
        return time.perf_counter() - t, np.asarray(x, np.float64).reshape(self.K, -1)

    def clipped_fraction(self, specs: list[tuple]) -> float:
        """Run 0's share of clipped samples in the checked round (DP-GD: round 1; DIFF2: its first
        difference round, at (x_1, x_0)), without noise."""
        x0 = np.asarray(self.x0, np.float64).reshape(self.K, -1)[0]
        if self.kind == "dpgd":
            return self.maths["clipped_fraction"](x0, None, specs[0][2])
        x1 = self.run(1, zero_noise=True)[1][0]
        return self.maths["clipped_fraction"](x1, x0, specs[0][3] * float(np.linalg.norm(x1 - x0)))


def _jax() -> tuple[Any, Any]:
    os.environ.setdefault("XLA_FLAGS", XLA_ONE_THREAD)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax  # noqa: PLC0415 -- optional, in the JAX interpreter; XLA_FLAGS must be set first

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp  # noqa: PLC0415 -- as jax above, once its settings are made

    return jax, jnp


def serve(stdin: Any, stdout: Any) -> None:
    """Answer pickled requests (see the module docstring) until ``("quit",)`` or end of input."""
    jax, jnp = _jax()
    maths: dict[str, Any] = {}
    cells: dict[str, tuple[JaxCell, list[tuple]]] = {}
    while True:
        try:
            req = pickle.load(stdin)
        except EOFError:
            return
        op = req[0]
        if op == "quit":
            return
        if op == "setup":
            _, A, Y, mask, sizes, hidden = req
            maths.update(build_maths(jax, jnp, A, Y, mask, sizes, hidden))
            reply: Any = {"jax": jax.__version__, "numpy": np.__version__, "python": sys.executable,
                          "xla_flags": os.environ.get("XLA_FLAGS", ""),
                          "affinity": sorted(os.sched_getaffinity(0))
                          if hasattr(os, "sched_getaffinity") else None}
        elif op == "build":
            _, name, kind, variant, dtype, specs, x0 = req
            cell = JaxCell(jax, jnp, maths, kind, variant, dtype, specs, x0)
            cells[name] = (cell, specs)
            reply = {"compile_s": cell.compile_s}
        elif op == "run":
            _, name, rounds, zero_noise = req
            seconds, x = cells[name][0].run(rounds, zero_noise)
            reply = {"s": seconds, "x": x}
        elif op == "clipped_fraction":
            cell, specs = cells[req[1]]
            reply = {"fraction": cell.clipped_fraction(specs)}
        elif op == "clipping":
            _, x, xp, A_rows, Y_rows, radii, dtype = req
            reply = maths["clipping_of"](x, xp, A_rows, Y_rows, radii, dtype)
        else:
            raise ValueError(
                f"Unknown request {op!r}; expected setup, build, run, clipped_fraction, clipping "
                f"or quit.")
        pickle.dump(reply, stdout)
        stdout.flush()


if __name__ == "__main__":
    _out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies on the pipe
    serve(sys.stdin.buffer, _out)
