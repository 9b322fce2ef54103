"""The batched engine's round backends: one round's clipped sums of every run, behind one interface.

A :class:`RoundBackend` takes the K runs' iterates x [K, d], which of them restart and their radii,
and returns the clipped sums per client and run [P, K, d] (float64), per client and run whether a
per-sample norm overflowed, and, when asked, the unclipped sums and losses at x that the evaluation
reads (by-products of the same pass). It keeps the pass at x for the next round, whose previous
iterate x is: every round costs one forward and backward pass.

Two implementations, chosen once per batch by :func:`choose_backend`:

- :class:`FusedBackend`, for an MLP with one hidden layer where the C++ kernel of
  :mod:`diff2_flwr.core.fused` loads: the forward pass of a group of clients in torch (compiled or
  not), the rest in one kernel call;
- :class:`TorchBackend` otherwise (deeper MLPs, or no C++ compiler): :func:`_round_core`, one client
  at a time, the closed forms of :mod:`diff2_flwr.core.ghost` (compiled or not). Same maths, slower.

A batch whose runs all sample their clients (issue 44) asks each round for the union of the runs'
cohorts only (``clients``): each computed client's results are the bits it gets when every client
is computed, and a client absent from the last round gets its pass at that round's iterate when it
returns (a difference round reads it).

Only the forward and backward passes run in the compute dtype; norms, clip factors and sums are
float64. The compiled functions are kept per MLP in a :class:`CompiledFunctions` (the process-wide
:data:`COMPILED` by default; ``COMPILED.clear()`` forgets them).

References:
    Murata & Suzuki (2023), Algorithm 1 (worker lines), Algorithm 2 (ClippedMean);
    Li et al. (2022), "Large language models can be strong differentially private learners" (ghost
    clipping).
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from ..core import fused
from ..core.clipping import RADIUS_FLOOR, clip_factors
from ..core.ghost import (
    MLP, Pass, clipped_sums, forward, forward_head, norm_bounds, prepare_for_compile,
)
from ..task.data import PreparedData

__all__ = ["Batch", "ClientGroup", "RoundOut", "RoundBackend", "FusedBackend", "TorchBackend",
           "CompiledFunctions",
           "COMPILED", "choose_backend", "retain_freed_memory"]

#: Up to this many input features the fused kernel adds the first layer's weight sums itself (per
#: lane, in the caches); with more, a batched matrix product of its c·dg_1 [K, H, M] does it faster.
#: Measured (K = 18 or 8, float32, compiled, CPU ms per round): California's 8 features, 20-24 in
#: the kernel against 26-28 with the product; KDD Cup 99's 118, 1.25x the torch path's time in the
#: kernel, 0.78x with the product. The crossover between them was not measured.
KERNEL_W1_FEATURES = 32


@dataclass(frozen=True)
class ClientGroup:
    """Clients' samples side by side for the fused path: inputs [F, M] (compute dtype and float64),
    targets, ‖x‖², mask [M]. ``blocked``: the two inputs are in the kernel's blocked layout
    (:func:`~diff2_flwr.core.fused.to_blocked`), as the kernel's own forward pass reads them (and
    writes its parts). ``members``: which clients, in order (consecutive ones in
    :meth:`Batch.groups`, any subset in :meth:`Batch.gather`)."""

    clients: int
    a_t: torch.Tensor
    y: torch.Tensor
    x64_t: torch.Tensor
    sq_a: torch.Tensor
    mask: torch.Tensor
    # [clients, N, F] float64 when the first layer's sums are a matrix product (with two_valued:
    # [clients, N, F_D], the dense columns only)
    x_rows: torch.Tensor | None
    blocked: bool = False
    #: the two-valued columns' layout and entries (:func:`~diff2_flwr.core.fused.two_valued`)
    two_valued: fused.TwoValued | None = None
    #: the clients' indices in the batch, in order (None: not recorded)
    members: np.ndarray | None = None

    def to_blocked(self, block: int) -> ClientGroup:
        """This group (in rows) with its inputs in the kernel's blocked layout (blocks of ``block``
        samples)."""
        return replace(self, a_t=fused.to_blocked(self.a_t, self.clients, block),
                       x64_t=fused.to_blocked(self.x64_t, self.clients, block), blocked=True)


class Batch:
    """Padded shard tensors: samples innermost, client p's samples at m = p·N + n, on ``device``
    (the CPU by default; a CUDA device runs the torch backend there). The shard sizes ``n`` stay on
    the CPU, where the server's step runs."""

    def __init__(self, data: PreparedData, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or "cpu")
        sizes = data.shard_sizes
        self.P, self.N, self.F = len(sizes), max(sizes), data.num_features
        a = torch.zeros(self.P, self.N, self.F, dtype=dtype)
        y = torch.zeros(self.P, self.N, dtype=dtype)
        mask = torch.zeros(self.P, self.N, dtype=dtype)
        for p in range(self.P):
            xs, ys = data.shard(p)
            a[p, : len(ys)] = torch.as_tensor(xs, dtype=dtype)
            y[p, : len(ys)] = torch.as_tensor(ys, dtype=dtype)
            mask[p, : len(ys)] = 1
        a, y, mask = a.to(self.device), y.to(self.device), mask.to(self.device)
        self.y, self.mask = y.reshape(-1), mask.reshape(-1).to(torch.float64)
        self.a64 = a.to(torch.float64)  # for the float64 clipped sums (exact from float32)
        self.a_t = a.reshape(-1, self.F).T.contiguous()  # [F, M]: samples innermost
        a64_t = self.a64.reshape(-1, self.F).T
        self.sq_a = (a64_t * a64_t).sum(0)  # ||a||² per sample, float64
        self.n = torch.tensor(sizes, dtype=torch.float64)
        # One client at a time in a round: its [K, width, N] intermediates stay in the caches, where
        # the whole batch's [K, width, P·N] would stream through memory once per kernel.
        self.clients = [(self.a_t[:, p * self.N:(p + 1) * self.N].contiguous(), self.a64[p:p + 1],
                         self.y[p * self.N:(p + 1) * self.N],
                         self.sq_a[p * self.N:(p + 1) * self.N],
                         self.mask[p * self.N:(p + 1) * self.N]) for p in range(self.P)]
        self.a64_t = a64_t
        self.x_test_t = torch.as_tensor(data.x_test, dtype=dtype).T.contiguous().to(self.device)
        self.y_test = torch.as_tensor(data.y_test, dtype=dtype).to(self.device)
        self.dtype = dtype
        self._two_valued: tuple[torch.Tensor, ...] | None = None
        self._blocked_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def two_valued_columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The columns taking at most two values over the test split's records, with their base and
        other values (:func:`~diff2_flwr.core.fused.two_valued_columns`), found once. The test
        split, not the training records: the layout then depends on no training record (a
        neighbouring dataset gets the same one, and float32 accumulation's 2C holds exactly); a
        training record outside it is an exception entry, taken exactly."""
        if self._two_valued is None:
            records = self.x_test_t.T.cpu().to(torch.float64).contiguous()
            self._two_valued = fused.two_valued_columns(records)
        return self._two_valued  # type: ignore[return-value]

    def groups(self, runs: int, width: int, cap: int = 32 << 20, *,
               two_valued: bool = False) -> list[ClientGroup]:
        """Clients in groups of consecutive ones (equal sizes but the last) whose [runs, width,
        samples] tensors in the compute dtype stay under ``cap`` bytes (at least one client each):
        one forward call and one fused kernel call per group and round. Under 32 MB glibc reuses
        their memory (see retain_freed_memory). ``two_valued`` (more than
        :data:`KERNEL_W1_FEATURES` features): each group's :class:`~diff2_flwr.core.fused.TwoValued`
        of :meth:`two_valued_columns`, its ``x_rows`` the dense columns only."""
        size = self.group_size(runs, width, cap)
        layout = self.two_valued_columns() if two_valued else None
        out = []
        for p0 in range(0, self.P, size):
            cols = slice(p0 * self.N, min(self.P, p0 + size) * self.N)
            rows = self.a64[p0:p0 + size] if self.F > KERNEL_W1_FEATURES else None
            tv = None
            if layout is not None and rows is not None:
                tv = fused.two_valued(rows, self.mask[cols], *layout)
                rows = rows[..., tv.dense].contiguous()
            members = np.arange(p0, min(self.P, p0 + size))
            out.append(ClientGroup(len(members), self.a_t[:, cols].contiguous(), self.y[cols],
                                   self.a64_t[:, cols].contiguous(), self.sq_a[cols],
                                   self.mask[cols], rows, two_valued=tv, members=members))
        return out

    def group_size(self, runs: int, width: int, cap: int = 32 << 20) -> int:
        """The most clients per group whose [runs, width, samples] tensors in the compute dtype stay
        under ``cap`` bytes (at least one): :meth:`groups`' and :meth:`gather`'s."""
        per_client = runs * width * self.N * torch.finfo(self.dtype).bits // 8
        return max(1, min(self.P, cap // max(1, per_client)))

    def gather(self, members: np.ndarray, *, blocked: int | None = None,
               two_valued: bool = False) -> ClientGroup:
        """The clients ``members`` (sorted batch indices, any subset) side by side in one
        :class:`ClientGroup`, copied: what :meth:`groups` makes of consecutive clients, the same
        values in the same per-client layout (a round of sampled runs computes its cohorts' union
        only).

        Args:
            members: the clients, in order.
            blocked: the inputs in the kernel's blocked layout of blocks of ``blocked`` samples
                (from whole-batch copies made once), as :meth:`ClientGroup.to_blocked` puts them.
            two_valued: the group's :class:`~diff2_flwr.core.fused.TwoValued` of
                :meth:`two_valued_columns` (as :meth:`groups`).
        """
        idx = torch.from_numpy(np.asarray(members, dtype=np.int64))
        G, N, F = len(idx), self.N, self.F
        y, sq_a, mask = (t.view(self.P, N).index_select(0, idx).reshape(-1)
                         for t in (self.y, self.sq_a, self.mask))
        a64 = self.a64.index_select(0, idx)  # [G, N, F]
        if blocked:
            a_full, x_full = self._blocked(blocked)
            # the blocked layout is client-major ([P, N·F] in memory): a subset is whole rows
            a_t = a_full.view(self.P, N * F).index_select(0, idx).view(F, G * N)
            x64_t = x_full.view(self.P, N * F).index_select(0, idx).view(F, G * N)
        else:
            a_t = self.a_t.view(F, self.P, N).index_select(1, idx).reshape(F, G * N)
            x64_t = a64.reshape(G * N, F).T.contiguous()
        rows = a64 if F > KERNEL_W1_FEATURES else None
        tv = None
        if two_valued and rows is not None:
            tv = fused.two_valued(rows, mask, *self.two_valued_columns())
            rows = rows[..., tv.dense].contiguous()
        return ClientGroup(G, a_t, y, x64_t, sq_a, mask, rows, blocked=bool(blocked),
                           two_valued=tv, members=np.asarray(members, dtype=np.int64))

    def _blocked(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch's inputs (compute dtype, float64) in the kernel's blocked layout, made
        once per block size."""
        if block not in self._blocked_inputs:
            self._blocked_inputs[block] = (
                fused.to_blocked(self.a_t, self.P, block),
                fused.to_blocked(self.a64_t.contiguous(), self.P, block))
        return self._blocked_inputs[block]


class RoundOut(NamedTuple):
    """One round of every run: clipped sums [P, K, d] (float64), overflow [P, K] (bool: a per-sample
    norm was not finite) and, when asked, the unclipped sums [P, K, d] and losses [K, M] (float64)
    at the round's iterate. A round of some clients only (``clients``) has their rows, in order:
    [|clients|, K, d] and [|clients|, K]."""

    sums: torch.Tensor
    overflow: torch.Tensor
    train: tuple[torch.Tensor, torch.Tensor] | None


class RoundBackend(Protocol):
    """How the batched engine computes a round; one per batch, holding the previous round's pass."""

    batch: Batch

    def round(self, x: torch.Tensor, restart: torch.Tensor, radius: torch.Tensor, *, train: bool,
              keep: bool = True, clients: np.ndarray | None = None) -> RoundOut:
        """Round of iterates x [K, d] (float64): rows with ``restart`` [K] take plain gradients, the
        others the difference with the previous round's pass; ``radius`` [K] float64; ``train``:
        also the unclipped sums (every client's: ``clients`` None); ``keep`` False: the next round
        restarts every run, so this round's pass need not be kept for it. ``clients``: the sorted
        indices of the clients to compute (None: all P), for a batch whose runs all sample their
        clients: each client's rows are the bits it gets when every client is computed — a client
        absent from the last round gets its pass at that round's iterate first, as that round
        would have computed it."""
        ...

    def train(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped sums [P, K, d] and losses [K, M] (float64) at x, outside a round (the last
        evaluation)."""
        ...


def _members(clients: np.ndarray | None, P: int, train: bool, who: str) -> np.ndarray:
    """A round's clients as sorted distinct int64 indices in 0 .. P-1 (None: all P); a ValueError
    naming ``who`` for others, or for an evaluated round (``train``) of some clients only."""
    if clients is None:
        return np.arange(P)
    members = np.asarray(clients, dtype=np.int64).reshape(-1)
    if len(members) and (members[0] < 0 or members[-1] >= P or (np.diff(members) <= 0).any()):
        raise ValueError(f"{who}: clients must be sorted distinct indices in 0..{P - 1}. Found "
                         f"{np.asarray(clients).tolist()}.")
    if train and len(members) != P:
        raise ValueError(f"{who}: an evaluated round (train=True) reads every client's pass; "
                         f"found {len(members)} clients of {P}. Pass clients=None.")
    return members


def _round_core(  # noqa: PLR0913 -- compiled on flat tensors: a client's data and the round's state
        mlp: MLP, a_t, a64, y, sq_a, mask, x, prev_inputs, prev_grads, restart, radius,
        some_restart: bool):
    """One round for every run: clipped sums per client [P, K, d] (float64); per client and run [P,
    K], whether a per-sample (difference) gradient's norm was not finite (an overflow); and this
    round's pass at x (in the compute dtype), which the next round reuses as its previous iterate's.

    ``prev_grads`` empty: every run restarts (no previous pass needed); ``some_restart``: some run
    restarts (the others take differences). Only the forward and backward passes run in the compute
    dtype; norms, clip factors and sums are float64 (the float64 copies of the passes are taken
    where they are read).
    """
    pass_ = forward(mlp, x, a_t, y)
    cur = pass_.to64()
    prev = None
    if prev_grads:
        prev = Pass(prev_inputs, prev_grads, cur.loss, cur.outputs).to64()
        if some_restart:
            prev = prev.restarting(cur, restart)
    norms, upper = norm_bounds(mlp, cur, a64.reshape(-1, a64.shape[-1]), sq_a, prev)
    rad = radius.unsqueeze(-1)
    c = clip_factors(upper, rad) * mask
    P, N = a64.shape[0], a64.shape[1]
    overflow = ((~torch.isfinite(norms)) & (mask > 0)).reshape(-1, P, N).any(-1).T
    return clipped_sums(cur, a64, c, prev), overflow, pass_.inputs, pass_.grads, pass_.loss


def _fused_round(  # noqa: PLR0913 -- a round's inputs, and the accumulation's
        kernel: fused.FusedKernel, head: Callable, group: ClientGroup, x: torch.Tensor,
        w_out: torch.Tensor, prev: fused.Parts | None, restart: torch.Tensor | None,
        radius: torch.Tensor, accumulate: str = "float64", rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, fused.Parts, torch.Tensor]:
    """What :func:`_round_core` gives, for a group of clients and an MLP with one hidden layer: the
    forward pass of their samples in torch (``head``: :func:`~diff2_flwr.core.ghost.forward_head`,
    compiled or not: one call), the rest in the fused kernel — clipped sums [clients, K, d]
    (float64), overflow [clients, K], and this round's parts and losses [K, M] (compute dtype),
    which the next round reuses as its previous iterate's. ``w_out``: the output layer's weights [K,
    O, H] in the compute dtype; ``prev`` None: every run restarts. ``accumulate``, ``rows``: the
    kernel's accumulation and, for float32, its ``x_rows``
    (:func:`~diff2_flwr.core.fused.product_rows` of the group's)."""
    a, dphi, g, loss = head(x, group.a_t, group.y)
    cur = fused.Parts(a.contiguous(), dphi.contiguous(), g.contiguous(), w_out)
    sums, overflow = fused.clipped_sums(kernel, cur, group.x64_t, group.sq_a, group.mask, radius,
                                        prev, restart, clients=group.clients,
                                        x_rows=group.x_rows if rows is None else rows,
                                        accumulate=accumulate, two_valued=group.two_valued)
    return sums, overflow, cur, loss


def _fused_rounds(  # noqa: PLR0913 -- stateless: the backend's parts and a round's inputs
        kernel: fused.FusedKernel, head: Callable | None, mlp: MLP, groups: Sequence[ClientGroup],
        x: torch.Tensor, prev: Sequence[fused.Parts] | None, restart: torch.Tensor | None,
        radius: torch.Tensor, keep: bool = True, accumulate: str = "float64",
        rows: Sequence[torch.Tensor | None] | None = None,
        spare: Sequence[fused.Parts | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[fused.Parts | None], torch.Tensor]:
    """:func:`_fused_round` for every group: sums [P, K, d], overflow [P, K], the parts per group,
    losses [K, M]. ``head`` None: the forward pass too is the kernel's
    (:func:`~diff2_flwr.core.fused.forward_sums`), which with ``keep`` False (the caller's promise:
    ``prev`` None, not evaluated) does not keep its parts (None per group), and with ``spare`` (per
    group: a pass no one reads any more, or None) writes the kept pass into it (the same bits, no
    fresh allocation: ``forward_sums``' ``out``). ``accumulate``, ``rows`` (per group): the
    kernel's accumulation and its float32 ``x_rows``."""
    rows = rows or [None] * len(groups)
    if head is None:
        params = x.to(groups[0].a_t.dtype).contiguous()
        outs = [fused.forward_sums(kernel, params, group.a_t, group.y, mlp.activations[0], mlp.loss,
                                   group.x64_t, group.sq_a, group.mask, radius,
                                   None if prev is None else prev[i], restart, hidden=mlp.sizes[1],
                                   outputs=mlp.sizes[2], clients=group.clients,
                                   x_rows=group.x_rows if rows[i] is None else rows[i],
                                   keep=keep, blocked=group.blocked, accumulate=accumulate,
                                   out=spare[i] if keep and spare is not None else None)
                for i, group in enumerate(groups)]
    else:
        w_out = _w_out(mlp, x, groups[0].a_t.dtype)
        outs = [_fused_round(kernel, head, group, x, w_out, None if prev is None else prev[i],
                             restart, radius, accumulate, rows[i])
                for i, group in enumerate(groups)]
    if len(outs) == 1:
        return outs[0][0], outs[0][1], [outs[0][2]], outs[0][3]
    return (torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), [o[2] for o in outs],
            torch.cat([o[3] for o in outs], dim=-1))


def _w_out(mlp: MLP, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output layer's weights W_2 [K, O, H] of the iterates x [K, d] in ``dtype``, contiguous:
    what the kernel reads beside a pass computed in torch."""
    return mlp.layers(x.to(dtype))[1][0].contiguous()


def _client_heads(head: Callable, x: torch.Tensor, clients: Sequence[tuple[torch.Tensor, ...]],
                  members: np.ndarray) -> list[tuple[torch.Tensor, ...]]:
    """``head`` (:func:`~diff2_flwr.core.ghost.forward_head`, compiled or not) at x for each of the
    clients ``members``, one call each on its own inputs (``clients``: :attr:`Batch.clients`).

    Every call has the same shape [F, N], so a client's bits are the same whichever clients a round
    computes: torch's matrix products and vectorised loops give bits that depend on a sample's
    place in a call and on the call's width (measured: float64's W_2 a of one client differs in a
    group of 40 and of 3), the fused kernel's do not. Rounds of client subsets take this forward
    pass (:class:`FusedBackend` with ``subsets``). Measured against one call for a group (54
    features, 7 classes, K = 8, float32, compiled, one thread): 2.2x its time at 50 samples a
    client (≈ 0.1 ms of overhead a call), 0.7x at 463 (a client's intermediates stay in the
    caches)."""
    return [head(x, clients[p][0], clients[p][2]) for p in members.tolist()]


class CompiledFunctions:
    """``torch.compile``'d round functions, one per (role, MLP): compiled on first use, reused by
    later batches of the same MLP (a compilation takes seconds). :data:`COMPILED` is the
    process-wide one; ``clear()`` forgets them (torch's own dynamo caches aside)."""

    def __init__(self) -> None:
        self._fns: dict[tuple[str, MLP], Callable] = {}

    def get(self, role: str, mlp: MLP, fn: Callable) -> Callable:
        """The compiled ``fn`` for (role, mlp), compiling ``fn`` only if there is none yet."""
        if (role, mlp) not in self._fns:
            # the norms' rescaling stays eager (a data-dependent number of samples)
            prepare_for_compile()
            self._fns[role, mlp] = torch.compile(fn, dynamic=True)
        return self._fns[role, mlp]

    def clear(self) -> None:
        """Forget every compiled function: the next batch of any MLP compiles again."""
        self._fns.clear()

    def __len__(self) -> int:
        return len(self._fns)


COMPILED = CompiledFunctions()


def _core(mlp: MLP, compile: bool, compiled: CompiledFunctions) -> Callable:
    """:func:`_round_core` of ``mlp`` without its first argument, compiled or not."""
    def core(*args):
        return _round_core(mlp, *args)
    return compiled.get("core", mlp, core) if compile else core


def _head(mlp: MLP, compile: bool, compiled: CompiledFunctions = COMPILED) -> Callable:
    """x, a_t, y -> :func:`~diff2_flwr.core.ghost.forward_head` of ``mlp``, compiled or not."""
    def head(x, a_t, y):
        return forward_head(mlp, x, a_t, y)
    return compiled.get("head", mlp, head) if compile else head


class TorchBackend:
    """Rounds by the closed forms of :mod:`diff2_flwr.core.ghost` in torch (:func:`_round_core`),
    one client at a time: any MLP the engine runs, with or without the fused kernel. Each call has
    one client's shape, so a round may compute any subset of the clients (``clients``) and each
    client's results are the bits it gets when every client is computed."""

    def __init__(self, mlp: MLP, batch: Batch, runs: int, *, compile: bool = False,
                 compiled: CompiledFunctions = COMPILED) -> None:
        self.mlp, self.batch, self.runs = mlp, batch, runs
        self._core = _core(mlp, compile, compiled)
        # Compiled, the restart selection always runs (fused, it costs little): two round shapes to
        # compile, not three.
        self._always_select = compile
        # per client: the pass at the last round's iterate (inputs, grads); None: not computed then
        self._prev: list[tuple[tuple, tuple] | None] = [((), ())] * batch.P
        # the last round's arguments on the device (x, restart, radius, flag), for passes computed
        # late (:meth:`_complete`)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None

    def round(self, x: torch.Tensor, restart: torch.Tensor, radius: torch.Tensor, *, train: bool,
              keep: bool = True, clients: np.ndarray | None = None) -> RoundOut:
        """:meth:`RoundBackend.round` one client at a time on the batch's device, the results on the
        CPU; this round's pass is kept whatever ``keep`` says. ``clients``: as
        :meth:`RoundBackend.round` (a client absent from the last round gets its pass there now)."""
        _check_radii(radius, "TorchBackend")
        members = _members(clients, self.batch.P, train, "TorchBackend")
        every = bool(restart.all())
        flag = self._always_select or bool(restart.any())
        # the round on the batch's device; what it returns on the CPU (the server's)
        device = self.batch.device
        x, restart, radius = x.to(device), restart.to(device), radius.to(device)
        if not every:
            self._complete(members)
        prevs = [((), ()) if every else self._prev[p] for p in members.tolist()]
        parts = [self._core(*self.batch.clients[p], x, *prev, restart, radius, flag)
                 for p, prev in zip(members.tolist(), prevs)]
        if not parts:  # no client this round (an empty union of cohorts)
            self._keep(members, parts, (x, restart, radius, flag))
            return RoundOut(torch.zeros(0, self.runs, self.mlp.dim, dtype=torch.float64),
                            torch.zeros(0, self.runs, dtype=torch.bool), None)
        sums = torch.cat([part[0] for part in parts])
        overflow = torch.cat([part[1] for part in parts])
        unclipped = None
        if train:
            joined = [torch.cat(ts,
                                dim=-1) for ts in zip(*(part[2] + part[3] + (part[4],)
                                                        for part in parts))]
            n_in = len(parts[0][2])
            joined_pass = Pass(tuple(joined[:n_in]), tuple(joined[n_in:-1]), joined[-1], joined[-1])
            unclipped = self._unclipped(joined_pass.to64())
        # the pass at x: the next round's previous iterate
        self._keep(members, parts, (x, restart, radius, flag))
        return RoundOut(sums.cpu(), overflow.cpu(), unclipped)

    def _keep(self, members: np.ndarray, parts: list, last: tuple) -> None:
        """This round's passes at x, of its clients (the others' are stale), and its arguments."""
        if len(members) == self.batch.P:
            self._prev = [(part[2], part[3]) for part in parts]
        else:
            self._prev = [None] * self.batch.P
            for p, part in zip(members.tolist(), parts):
                self._prev[p] = (part[2], part[3])
        self._last = last  # type: ignore[assignment]

    def _complete(self, members: np.ndarray) -> None:
        """The pass at the last round's iterate of each of ``members`` that round did not compute,
        computed now by the call the last round would have made for it: the same function (so, when
        compiled, the same graph: with or without a previous pass, as that round had), the same
        iterate, restarts and radii, on the client's own inputs — so the same bits. The previous
        pass that call would have read is replaced by zeros of its shapes: the pass at x depends on
        none of its values."""
        missing = [p for p in members.tolist() if self._prev[p] is None]
        if not missing:
            return
        if self._last is None:
            raise RuntimeError("TorchBackend: a difference round before any round (the first "
                               "round restarts every run).")
        x, restart, radius, flag = self._last
        blank = ((), ()) if bool(restart.all()) else self._blank()
        for p in missing:
            part = self._core(*self.batch.clients[p], x, *blank, restart, radius, flag)
            self._prev[p] = (part[2], part[3])

    def _blank(self) -> tuple[tuple, tuple]:
        """A previous pass of one client, zeros: the inputs of the layers after the first and every
        layer's output gradient [K, width, N], in the compute dtype on the batch's device."""
        b, sizes = self.batch, self.mlp.sizes
        zeros = [torch.zeros(self.runs, w, b.N, dtype=b.dtype, device=b.device) for w in sizes[1:]]
        return tuple(zeros[:-1]), tuple(zeros)

    def train(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`RoundBackend.train`: one forward and backward pass of the whole batch at x."""
        return self._unclipped(forward(self.mlp, x.to(self.batch.device), self.batch.a_t,
                                       self.batch.y).to64())

    def _unclipped(self, cur: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped gradient sums [P, K, d] and losses [K, M] of a float64 pass (on the CPU)."""
        return clipped_sums(cur, self.batch.a64, self.batch.mask.expand(self.runs,
                                                                        -1)).cpu(), cur.loss.cpu()


class FusedBackend:
    """Rounds of an MLP with one hidden layer by the fused kernel (:mod:`diff2_flwr.core.fused`),
    clients in the groups of :meth:`Batch.groups`: per group one kernel call that does the forward
    pass too (``forward="kernel"``: each block of samples goes through the whole round while it is
    in the caches), or one forward call in torch (``head``, compiled or not) and one kernel call
    (``forward="torch"``). By default the kernel's up to :data:`KERNEL_W1_FEATURES` input features,
    torch's above: the kernel computes W_1 x in lane loops, and with many features a matrix product
    wins (measured on KDD Cup 99's 118, K = 8, float32, compiled, one thread: 147 ms CPU per
    configuration-round with the kernel's forward against 62 ms with torch's).

    ``two_valued`` (opt-in; torch's forward, more than :data:`KERNEL_W1_FEATURES` features and at
    least :data:`~diff2_flwr.core.fused.TWO_VALUED_MIN_COLUMNS` columns that take two values over
    the test split, :meth:`Batch.two_valued_columns`): the first layer's sums of those columns
    from the kernel's minority sums (:mod:`diff2_flwr.core.fused`, "Two-valued columns"), the
    dense columns' as before; float32
    accumulation then clips at its slightly larger ρ. Refused in one line where it cannot apply.

    ``accumulate="float32"`` (a float32 batch only; default "float64"): the rounds' clipped sums
    through the kernel's float32 accumulation (:mod:`diff2_flwr.core.fused`: clipped at a radius
    shorter by ρ ≈ 2.4e-4, 3.5e-4 with block products, so that each client sum's sensitivity stays
    2C); the evaluation's unclipped sums stay float64.

    ``subsets`` (a batch whose runs all sample their clients): a round computes the clients it is
    given (``clients``, the union of the runs' cohorts) and keeps each client's pass; a client
    absent from the last round gets its pass at that round's iterate when it returns. With the
    kernel's forward, in groups gathered for the round (:meth:`_group_round`): the kernel's bits
    for a client do not depend on the other clients of its call. With torch's, client by client,
    its forward pass and its kernel call (:meth:`_client_round`): torch's bits depend on a sample's
    place in a call (:func:`_client_heads`), so the forward pass runs one client a call — the bits
    of sampled runs on torch's forward are then not those of the same runs in a batch without
    ``subsets`` (equal to rounding), but a round of some clients equals, bit for bit, the same
    round of every client."""

    def __init__(  # noqa: PLR0913 -- keyword-only options, as choose_backend's
            self, kernel: fused.FusedKernel, mlp: MLP, batch: Batch, runs: int, *,
                 compile: bool = False, compiled: CompiledFunctions = COMPILED,
                 forward: str | None = None, accumulate: str = "float64",
                 two_valued: bool = False, subsets: bool = False) -> None:
        _check_accumulate(accumulate, batch, "FusedBackend")
        if batch.device.type != "cpu":
            raise ValueError(
                f"FusedBackend runs on the CPU; this batch is on {batch.device}. Use TorchBackend "
                f"(or "
                             "choose_backend) for it.")
        if len(mlp.sizes) != 3:
            raise ValueError(
                f"FusedBackend runs an MLP with one hidden layer. Found widths {mlp.sizes}; use "
                             "TorchBackend (or choose_backend) for it.")
        # the kernel's own W_1 x is lane loops: a matrix product is faster with many features
        if forward is None:
            forward = "kernel" if batch.F <= KERNEL_W1_FEATURES else "torch"
        if forward not in ("kernel", "torch"):
            raise ValueError(
                f"FusedBackend: forward must be 'kernel' or 'torch'. Found {forward!r}.")
        if two_valued:
            _check_two_valued(batch, forward)
        self.kernel, self.mlp, self.batch, self.runs = kernel, mlp, batch, runs
        self.head = None if forward == "kernel" else _head(mlp, compile, compiled)
        self.accumulate, self.subsets, self.two_valued = accumulate, subsets, two_valued
        self._no_clip = torch.full((runs,), math.inf, dtype=torch.float64)
        width = max(mlp.sizes[1:])
        if subsets:
            self.groups: list[ClientGroup] = []
            self._last: torch.Tensor | None = None  # the iterate of the kept passes
            if self.head is None:  # the kernel's forward: groups gathered per round (_gather)
                self._size = batch.group_size(runs, width)
                self._kept = _KeptParts(batch.P, batch.N)
            else:  # torch's forward: client by client, and one kernel call per client
                self._inputs = _ClientInputs(batch, accumulate, two_valued)
                self._passes: list[fused.Parts | None] = [None] * batch.P
            return
        self.groups = (batch.groups(runs, width, two_valued=True) if two_valued
                       else batch.groups(runs, width))
        # the kernel's forward: inputs and parts in its blocked layout (same bits, fewer streams)
        if self.head is None:
            self.groups = [group.to_blocked(kernel.block) for group in self.groups]
        self._rows = [self._product_rows(group) for group in self.groups]
        self._prev: list[fused.Parts] | None = None  # per group: the parts at x
        self._spare: list[fused.Parts | None] | None = None  # the pass before (read by no one)

    def round(self, x: torch.Tensor, restart: torch.Tensor, radius: torch.Tensor, *, train: bool,
              keep: bool = True, clients: np.ndarray | None = None) -> RoundOut:
        """:meth:`RoundBackend.round` by the fused kernel, group by group; a RuntimeError for a
        difference round after a round that promised (``keep`` False) that none would follow.
        ``clients`` (a backend built with ``subsets``): the round's clients, as
        :meth:`RoundBackend.round`."""
        _check_radii(radius, "FusedBackend")
        if self.subsets:
            members = _members(clients, self.batch.P, train, "FusedBackend")
            subset_round = self._group_round if self.head is None else self._client_round
            return subset_round(x, restart, radius, train, keep, members)
        if clients is not None:
            raise ValueError("FusedBackend: a round of some clients needs a backend built with "
                             "subsets=True (choose_backend(..., subsets=True)); this one computes "
                             "every client each round.")
        prev = None if bool(restart.all()) else self._prev
        if prev is not None and any(p is None for p in prev):
            raise RuntimeError(
                "FusedBackend: a difference round after a round whose pass was not kept "
                "(keep=False promised that the next round restarts every run).")
        # The kernel's forward keeps no pass that no one reads: a round of plain gradients before
        # one that restarts every run, not evaluated (the evaluation's unclipped sums read it).
        keep = keep or train or prev is not None
        # the kernel's forward writes this round's pass into the one it replaces two rounds on
        # (read by no one: the last round's is ``prev``), not into fresh memory (page faults)
        spare = self._spare if self.head is None else None
        sums, overflow, parts, loss = _fused_rounds(self.kernel, self.head, self.mlp, self.groups,
                                                    x, prev, restart, radius, keep,
                                                    self.accumulate, self._rows, spare)
        self._spare, self._prev = self._prev, parts
        return RoundOut(sums, overflow, self._unclipped(self._prev, loss) if train else None)

    def train(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`RoundBackend.train`: a round of plain gradients with no clipping (radius ∞)."""
        if self.subsets and self.head is not None:
            w_out = _w_out(self.mlp, x, self.batch.dtype)
            passes = [self._client_pass(x, w_out, p) for p in range(self.batch.P)]
            return self._clients_unclipped(np.arange(self.batch.P), passes)
        groups = self._gather(np.arange(self.batch.P)) if self.subsets else self.groups
        sums, _, _, loss = _fused_rounds(self.kernel, self.head, self.mlp, groups, x, None,
                                         None, self._no_clip)
        return sums, loss.to(torch.float64)

    def _unclipped(self, parts: list[fused.Parts], loss: torch.Tensor,
                   groups: Sequence[ClientGroup] | None = None) -> tuple[torch.Tensor,
                                                                        torch.Tensor]:
        """Unclipped gradient sums [P, K, d] and losses [K, M] (float64) of this round's parts (of
        ``groups``: this round's, by default :attr:`groups`)."""
        sums = [fused.clipped_sums(self.kernel, part, group.x64_t, group.sq_a, group.mask,
                                   self._no_clip, clients=group.clients, x_rows=group.x_rows,
                                   two_valued=group.two_valued)[0]
                for part, group in zip(parts, self.groups if groups is None else groups)]
        return (sums[0] if len(sums) == 1 else torch.cat(sums)), loss.to(torch.float64)

    def _product_rows(self, group: ClientGroup) -> torch.Tensor | None:
        """Float32 accumulation's ``x_rows`` of a group (:func:`~diff2_flwr.core.fused.
        product_rows`), or None (float64 accumulation, or the kernel's own W_1 sums)."""
        if self.accumulate == "float64" or group.x_rows is None:
            return None
        return fused.product_rows(group.x_rows)

    def _gather(self, members: np.ndarray) -> list[ClientGroup]:
        """The clients ``members`` in groups of at most :meth:`Batch.group_size` consecutive ones
        of them, gathered (:meth:`Batch.gather`) in this backend's layout."""
        return [self.batch.gather(members[i:i + self._size], blocked=self.kernel.block,
                                  two_valued=self.two_valued)
                for i in range(0, len(members), self._size)]

    def _group_round(self, x: torch.Tensor, restart: torch.Tensor, radius: torch.Tensor,
                     train: bool, keep: bool, members: np.ndarray) -> RoundOut:
        """:meth:`round` of the clients ``members`` (sorted) with ``subsets`` and the kernel's
        forward: their groups gathered, their previous passes joined from where they were kept
        (:class:`_KeptParts`), this round's kept for the next."""
        prev = None
        if not bool(restart.all()):
            self._complete_groups(members)
        groups = self._gather(members)
        if not bool(restart.all()):
            prev = [self._kept.join(group.members) for group in groups]  # type: ignore[arg-type]
        self._kept.forget()
        self._last = x
        if not groups:  # no client this round (an empty union of cohorts)
            return RoundOut(torch.zeros(0, self.runs, self.mlp.dim, dtype=torch.float64),
                            torch.zeros(0, self.runs, dtype=torch.bool), None)
        keep = keep or train or prev is not None
        sums, overflow, parts, loss = _fused_rounds(
            self.kernel, self.head, self.mlp, groups, x, prev, restart, radius, keep,
            self.accumulate, [self._product_rows(group) for group in groups])
        for group, part in zip(groups, parts):
            if part is not None:
                self._kept.put(group.members, part)  # type: ignore[arg-type]
        return RoundOut(sums, overflow, self._unclipped(parts, loss, groups) if train else None)

    def _client_round(self, x: torch.Tensor, restart: torch.Tensor, radius: torch.Tensor,
                      train: bool, keep: bool, members: np.ndarray) -> RoundOut:
        """:meth:`round` of the clients ``members`` with ``subsets`` and torch's forward: client by
        client, its forward pass (:func:`_client_heads`) and its kernel call on its own inputs
        (:class:`_ClientInputs`) and its previous pass — no group is gathered or joined, and a
        client's parts go from the forward pass to the kernel while they are in the caches. Measured
        (K = 8, float32, compiled, one thread): a kernel call costs ≈ 20-70 µs more than its share
        of a group's, and at 300-600 samples a client is no slower than in a group of 8."""
        every = bool(restart.all())
        if not every:
            self._complete_clients(members)
        w_out = _w_out(self.mlp, x, self.batch.dtype)
        passes: list[fused.Parts | None] = [None] * self.batch.P
        sums, flags, losses = [], [], []
        inputs = self._inputs
        for p in members.tolist():
            cur, loss = self._client_pass(x, w_out, p)
            s, o = fused.clipped_sums(self.kernel, cur, *inputs.kernel(p), radius,
                                      None if every else self._passes[p], restart, clients=1,
                                      x_rows=inputs.rows(p, self.accumulate),
                                      accumulate=self.accumulate, two_valued=inputs.two_valued(p))
            sums.append(s)
            flags.append(o)
            losses.append(loss)
            passes[p] = cur
        self._last = x
        # kept for a difference round (or the evaluation); else let them go
        self._passes = passes if keep or train else [None] * self.batch.P
        if not sums:  # no client this round (an empty union of cohorts)
            return RoundOut(torch.zeros(0, self.runs, self.mlp.dim, dtype=torch.float64),
                            torch.zeros(0, self.runs, dtype=torch.bool), None)
        unclipped = None
        if train:
            unclipped = self._clients_unclipped(members, [(passes[p], losses[i]) for i, p in
                                                          enumerate(members.tolist())])
        return RoundOut(torch.cat(sums), torch.cat(flags), unclipped)

    def _client_pass(self, x: torch.Tensor, w_out: torch.Tensor,
                     p: int) -> tuple[fused.Parts, torch.Tensor]:
        """Client p's forward pass at x in torch (:func:`_client_heads`) as the kernel's parts
        (with ``w_out``, x's W_2), and its losses [K, N]."""
        (a, dphi, g, loss), = _client_heads(self.head, x, self.batch.clients,  # type: ignore[arg-type]
                                            np.array([p]))
        return fused.Parts(a.contiguous(), dphi.contiguous(), g.contiguous(), w_out), loss

    def _clients_unclipped(self, members: np.ndarray, passes: Sequence[tuple[fused.Parts,
                                                                             torch.Tensor]]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unclipped gradient sums [P, K, d] and losses [K, M] (float64) of each client's pass
        (``passes``: (parts, losses) of the clients ``members``, every client), one kernel call
        each."""
        inputs = self._inputs
        sums = [fused.clipped_sums(self.kernel, cur, *inputs.kernel(p), self._no_clip, clients=1,
                                   x_rows=inputs.rows(p, "float64"),
                                   two_valued=inputs.two_valued(p))[0]
                for p, (cur, _) in zip(members.tolist(), passes)]
        return torch.cat(sums), torch.cat([loss for _, loss in passes], dim=-1).to(torch.float64)

    def _complete_clients(self, members: np.ndarray) -> None:
        """:meth:`_complete_groups` client by client: torch's forward pass at the last round's
        iterate of each of ``members`` that has none kept — the call that round made for it, so
        the same bits."""
        missing = [p for p in members.tolist() if self._passes[p] is None]
        if not missing:
            return
        if self._last is None:
            raise RuntimeError("FusedBackend: a difference round before any round (the first "
                               "round restarts every run).")
        w_out = _w_out(self.mlp, self._last, self.batch.dtype)
        for p in missing:
            self._passes[p] = self._client_pass(self._last, w_out, p)[0]

    def _complete_groups(self, members: np.ndarray) -> None:
        """The pass at the last round's iterate of each of ``members`` that has none kept (absent
        from the last round, or not kept there), computed now as that round would have: the
        kernel's forward pass (a call of plain gradients, unclipped: its parts are the forward pass
        at that iterate whatever the rest of the call, and a client's bits do not depend on the
        other clients of the call) — the same bits as that round's."""
        missing = self._kept.missing(members)
        if not len(missing):
            return
        if self._last is None:
            raise RuntimeError("FusedBackend: a difference round before any round (the first "
                               "round restarts every run).")
        x = self._last
        groups = self._gather(missing)
        _, _, parts, _ = _fused_rounds(self.kernel, None, self.mlp, groups, x, None, None,
                                       self._no_clip)
        for group, part in zip(groups, parts):
            self._kept.put(group.members, part)  # type: ignore[arg-type]


class _ClientInputs:
    """Each client's inputs to a kernel call of its own (:class:`FusedBackend` with ``subsets`` and
    torch's forward), made once: float64 inputs [F, N], ‖x‖² and mask [N]; the first layer's rows
    for its products (more than :data:`KERNEL_W1_FEATURES` features: [1, N, F] float64, the dense
    columns only with two-valued columns, and their :func:`~diff2_flwr.core.fused.product_rows`
    for float32 accumulation); its :class:`~diff2_flwr.core.fused.TwoValued` (made on first use)."""

    def __init__(self, batch: Batch, accumulate: str, two_valued: bool) -> None:
        self.batch = batch
        self.x64 = batch.a64.transpose(1, 2).contiguous()  # [P, F, N]: client p's [F, N] in a row
        self.layout = batch.two_valued_columns() if two_valued else None
        rows = batch.a64 if batch.F > KERNEL_W1_FEATURES else None
        if rows is not None and self.layout is not None:
            dense = torch.ones(batch.F, dtype=torch.bool)
            dense[self.layout[0]] = False
            rows = rows[..., dense].contiguous()
        self.rows64 = rows
        self.rows32 = (fused.product_rows(rows) if rows is not None and accumulate == "float32"
                       else None)
        self._two_valued: list[fused.TwoValued | None] = [None] * batch.P

    def kernel(self, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Client p's float64 inputs [F, N], ‖x‖² and mask [N], as the kernel reads them."""
        N = self.batch.N
        return (self.x64[p], self.batch.sq_a[p * N:(p + 1) * N],
                self.batch.mask[p * N:(p + 1) * N])

    def rows(self, p: int, accumulate: str) -> torch.Tensor | None:
        """Client p's ``x_rows`` for the kernel's ``accumulate`` (None: the kernel's own W_1
        sums)."""
        rows = self.rows32 if accumulate == "float32" else self.rows64
        return None if rows is None else rows[p:p + 1]

    def two_valued(self, p: int) -> fused.TwoValued | None:
        """Client p's two-valued entries (None without two-valued columns)."""
        if self.layout is None or self.rows64 is None:
            return None
        if self._two_valued[p] is None:
            N = self.batch.N
            self._two_valued[p] = fused.two_valued(self.batch.a64[p:p + 1],
                                                   self.batch.mask[p * N:(p + 1) * N],
                                                   *self.layout)
        return self._two_valued[p]


class _KeptParts:
    """Each client's pass at a backend's last iterate (:class:`FusedBackend` with ``subsets``):
    where it lies — a pass of clients side by side (:class:`~diff2_flwr.core.fused.Parts`, rows or
    blocked) and the client's place in it — or nothing (not computed at that iterate)."""

    def __init__(self, clients: int, N: int) -> None:
        self.N = N
        self.at: list[tuple[fused.Parts, int, int] | None] = [None] * clients

    def forget(self) -> None:
        """No client's pass is at the next iterate yet."""
        self.at = [None] * len(self.at)

    def put(self, members: np.ndarray, parts: fused.Parts) -> None:
        """The pass ``parts`` of the clients ``members``, side by side in that order."""
        for j, p in enumerate(members.tolist()):
            self.at[p] = (parts, j, len(members))

    def missing(self, members: np.ndarray) -> np.ndarray:
        """The clients of ``members`` that have no pass kept."""
        return members[np.array([self.at[p] is None for p in members.tolist()], dtype=bool)]

    def join(self, members: np.ndarray) -> fused.Parts:
        """The passes of ``members`` (every one kept) side by side in that order, in their layout:
        the kept tensors themselves where they are one pass's clients in order, else a copy of each
        client's slice (its N samples of every row; in the blocked layout one contiguous run of
        each run's memory)."""
        at = [self.at[p] for p in members.tolist()]
        first = at[0][0]  # type: ignore[index]
        if all(a[0] is first and a[1] == j and a[2] == len(at)  # type: ignore[index]
               for j, a in enumerate(at)):
            return first
        K, N, G = first.a.shape[0], self.N, len(at)

        def joined(i: int) -> torch.Tensor:
            rows = first[i].shape[1]
            if first.blocked:  # client-major in memory: [K, clients, N·rows]
                out = torch.stack([parts[i].view(K, c, N * rows)[:, j]
                                   for parts, j, c in at], dim=1)  # type: ignore[misc]
            else:
                out = torch.stack([parts[i].view(K, rows, c, N)[:, :, j]
                                   for parts, j, c in at], dim=2)  # type: ignore[misc]
            return out.view(K, rows, G * N)

        return fused.Parts(joined(0), joined(1), joined(2), first.w_out, first.blocked)


def _check_radii(radius: torch.Tensor, who: str) -> None:
    """Refuse a round whose radius [K] is NaN, negative, or positive below
    :data:`~diff2_flwr.core.clipping.RADIUS_FLOOR` for some run (0 — a parked run's — and inf are
    taken), as :func:`~diff2_flwr.core.clipping.check_radius` refuses one radius: clipped values
    that small round by more than their size."""
    r = radius.detach().cpu().numpy()
    ok = (r >= RADIUS_FLOOR) | (r == 0)  # NaN fails both
    if not ok.all():
        k = int(np.flatnonzero(~ok)[0])
        raise ValueError(
            f"{who}: run {k}'s radius {r[k]:.3g} is NaN, negative or below {RADIUS_FLOOR:.3g} "
            "(clipped values that small round by more than their size, so no sensitivity bound "
            "holds); the round releases nothing.")


def _check_two_valued(batch: Batch, forward: str) -> None:
    """Refuse ``two_valued`` where it cannot apply: the kernel's forward (few features: its lanes
    take the first layer's sums), or fewer two-valued columns than pay."""
    if forward != "torch" or batch.F <= KERNEL_W1_FEATURES:
        raise ValueError(
            f"run_batch: two_valued is for torch's forward with more than {KERNEL_W1_FEATURES} "
            f"features (the first layer's sums by products); found {batch.F} features and the "
            f"{forward}'s forward. Drop two_valued.")
    found = batch.two_valued_columns()[0].numel()
    if found < fused.TWO_VALUED_MIN_COLUMNS:
        raise ValueError(
            f"run_batch: two_valued needs at least {fused.TWO_VALUED_MIN_COLUMNS} columns that "
            f"take two values over the test split's records to pay; found {found} of {batch.F}. "
            "Drop two_valued.")


def _check_accumulate(accumulate: str, batch: Batch, who: str) -> None:
    """Refuse an accumulation that is not 'float64', or 'float32' for a float32 batch (the same
    refusal whichever backend would run)."""
    if accumulate not in fused.ACCUMULATE or (accumulate == "float32"
                                              and batch.dtype != torch.float32):
        raise ValueError(f"{who}: accumulate must be 'float64', or 'float32' for a float32 batch. "
                         f"Found {accumulate!r} for {batch.dtype}.")


def choose_backend(mlp: MLP, batch: Batch, runs: int, *, compile: bool = False,
                   compiled: CompiledFunctions = COMPILED,
                   accumulate: str = "float64", two_valued: bool = False,
                   subsets: bool = False) -> RoundBackend:
    """The backend for ``runs`` runs of ``mlp`` on ``batch``, chosen once: the fused kernel for an
    MLP with one hidden layer where it loads (:func:`diff2_flwr.core.fused.load`: built once per
    machine, loaded once per process), the torch path otherwise.

    Args:
        mlp: the MLP every run trains.
        batch: the clients' padded samples.
        runs: the number of runs K.
        compile: whether the torch parts are ``torch.compile``'d.
        compiled: where compiled functions are kept (the process-wide :data:`COMPILED` by default).
        accumulate: the fused backend's accumulation (:class:`FusedBackend`); the torch backend
            always accumulates in float64.
        two_valued: the fused backend's two-valued columns path (:class:`FusedBackend`); refused
            where the torch backend would run.
        subsets: rounds may compute some clients only (:meth:`RoundBackend.round`'s ``clients``:
            the fused backend's ``subsets``; the torch backend computes any subset as it is).
    """
    _check_accumulate(accumulate, batch, "run_batch")
    kernel = fused.load() if len(mlp.sizes) == 3 and batch.device.type == "cpu" else None
    if kernel is None:  # deeper MLPs, no C++ compiler, or a batch on a GPU (the kernel is CPU code)
        if two_valued:
            raise ValueError(
                "run_batch: two_valued is the fused kernel's (an MLP with one hidden layer, on the "
                f"CPU, a C++ compiler); found widths {mlp.sizes} on {batch.device}"
                f"{'' if len(mlp.sizes) != 3 or batch.device.type != 'cpu' else ', no kernel'}. "
                "Drop two_valued.")
        return TorchBackend(mlp, batch, runs, compile=compile, compiled=compiled)
    return FusedBackend(kernel, mlp, batch, runs, compile=compile, compiled=compiled,
                        accumulate=accumulate, two_valued=two_valued, subsets=subsets)


def retain_freed_memory() -> None:
    """Let glibc keep freed blocks of up to 32 MB for reuse (a process setting; setting it again
    changes nothing). A round allocates its [K, width, M] tensors afresh; by default glibc maps each
    block over 128 kB (or the last freed size) from the OS and unmaps it on free, so every round
    pays a page fault per 4 kB touched: measured ≈ 3 ms of system time per round at K = 18 on
    California Housing (12 % of it). Values are unchanged; the process holds up to 256 MB of freed
    memory."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest
    mallopt(M_TRIM_THRESHOLD, 256 << 20)
