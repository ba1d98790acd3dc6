"""Row-sharded backend on ``torch.distributed``: every rank holds a shard of the rows.

FALKON touches the ``n`` rows only through passes whose results are ``M``-sized sums over
row blocks (docs/math.md §9): ``K_Mn (K_nM u + v)``, ``A A^T``, ``A y``, ``tr K~``,
``tr K_nn``, ``diag(K_Mn K_nM)``. Summing the per-rank results of such a pass gives the
single-process result, so a shard needs one ``all_reduce`` per pass (all right-hand sides and
all aggregates of the pass in one call). Everything ``M x M`` - ``K_MM``, its Cholesky
factors, the preconditioner - is computed on every rank from identical inputs
rather than on one rank and broadcast: the factorisation's wall time is the same either way
(one rank computes while the others would wait), and a broadcast adds ``2 x 8 M^2`` bytes of
traffic (``benchmarks/results/distributed.md`` measures both: at ``M = 2000``, 1 s of
factorisation against the broadcast's extra tens of milliseconds on loopback). On machines whose
BLAS rounds differently the ranks' ``M x M`` results may then differ at the rounding level.
CG's iteration itself (its ``M x k`` vectors, steps and stopping test) runs on rank 0 alone
(:meth:`DistributedBackend.lead_solve`): the other ranks run the data products it announces and
receive its solution, so ranks that round differently cannot drift apart or stop at different
iterations, and every rank's ``alpha`` is rank 0's bit for bit.
The global ``n`` (not the shard's) enters ``n lambda``.

Gradients (the objectives). Each rank evaluates the objective on the *joint* graph of all
ranks: :func:`all_reduce_sum` is differentiable with its true adjoint (the backward pass
all-reduces the incoming gradients), the loss's gradient is seeded with ``1 / world_size``
on every rank (:func:`scale_gradient`) and the parameters enter through
:func:`sum_gradients` (identity forward, all-reduced gradients backward). Every rank then
holds exactly the single-process gradient, so parameters stay identical after each
optimizer step. A rank with an empty shard still takes part in every collective: its
local sums are zeros tied to the parameters (:func:`all_reduce_sum`'s ``anchor``).

Written here because torch.distributed offers the collectives but not their use in a
Nyström solver; ``torch.distributed.nn.functional.all_reduce`` has the same adjoint but no
anchor for empty shards and one call per tensor.
"""
from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from gpytorch.kernels import Kernel
from torch import Tensor

from ..errors import DistributedError, FalkonConvergenceError
from .engine import KernelEngine
from .passes import WhitenedAggregates, whitened_aggregates

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistributedBackend",
    "ShardedEngine",
    "all_reduce_sum",
    "default_backend",
    "init_distributed",
    "scale_gradient",
    "sum_gradients",
]


#: the collective timeout :func:`init_distributed` sets (seconds)
DEFAULT_TIMEOUT_S = 300.0


def default_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` where CUDA and NCCL are available, else ``"gloo"``.

    One process group for both devices: collectives on CUDA tensors go through NCCL, those on CPU
    tensors through gloo. A plain ``"nccl"`` group cannot reduce CPU tensors ("No backend type
    associated with device type cpu"), which a machine with a GPU meets as soon as the rows, or
    any bookkeeping tensor, live on the host (seen on an H200, 2026-11-26)."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, **kw: Any) -> None:
    """``torch.distributed.init_process_group`` with a stated collective timeout.

    ``backend`` defaults to :func:`default_backend` (NCCL for CUDA tensors and gloo for CPU ones
    where CUDA is available, else gloo); the rendezvous
    comes from the environment ``torchrun`` / SLURM set (``MASTER_ADDR``, ``RANK``, ...) unless
    ``init_method`` is given. A rank that dies, raises or stops calling the collectives makes
    every other rank raise :class:`~gpfalkon.errors.DistributedError` within ``timeout_s``
    (gloo usually much sooner: a closed connection is seen at once).
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised")
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if backend is None:
        backend = default_backend()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=float(timeout_s)), **kw)


def _collective(what: str, call: Callable[[], Any]) -> Any:
    """Run a collective; a failure (dead / raising / late peer) becomes a DistributedError."""
    try:
        return call()
    except RuntimeError as exc:  # torch.distributed.DistBackendError is a RuntimeError
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise DistributedError(
            f"rank {rank}: {what} failed - another rank died, raised, or did not reach this collective within "
            f"the process group's timeout ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from exc


def shard_range(n: int, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(start, stop)``: the contiguous rows ``start .. stop - 1`` of ``n`` that rank ``rank`` of
    ``world_size`` holds (balanced: sizes differ by at most one; the shards in rank order are the
    rows in order). Defaults: this process's rank and world size."""
    if rank is None or world_size is None:
        _require_group(None)
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _require_group(group: Any | None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "gpfalkon's distributed backend needs an initialised torch.distributed process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up its environment)"
        )


def _flat(tensors: Sequence[Tensor]) -> tuple[Tensor, list[tuple[torch.Size, torch.dtype]]]:
    """One float64 buffer holding all ``tensors`` (one collective for all of them)."""
    meta = [(t.shape, t.dtype) for t in tensors]
    dev = tensors[0].device
    flat = torch.cat([t.detach().reshape(-1).to(device=dev, dtype=torch.float64) for t in tensors])
    return flat, meta


def _unflat(flat: Tensor, meta: list[tuple[torch.Size, torch.dtype]]) -> list[Tensor]:
    out, i = [], 0
    for shape, dtype in meta:
        k = 1
        for s in shape:
            k *= int(s)
        out.append(flat[i : i + k].reshape(shape).to(dtype))
        i += k
    return out


def _all_reduce_flat(tensors: Sequence[Tensor], group: Any | None) -> list[Tensor]:
    if not tensors:
        return []
    flat, meta = _flat(tensors)
    _collective(
        f"all_reduce of {flat.numel()} values", lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    )
    return _unflat(flat, meta)


class _AllReduceSum(torch.autograd.Function):
    """``out_i = sum over ranks of t_i`` (one collective); backward: the same sum of gradients."""

    @staticmethod
    def forward(ctx, group: Any | None, anchor: Tensor | None, *tensors: Tensor):
        ctx.group = group
        ctx.has_anchor = anchor is not None
        ctx.meta = [(t.dtype, t.device) for t in tensors]
        return tuple(_all_reduce_flat(tensors, group))

    @staticmethod
    def backward(ctx, *grads: Tensor):
        grads_in = [
            torch.zeros((), dtype=dt, device=dv) if g is None else g
            for g, (dt, dv) in zip(grads, ctx.meta, strict=False)
        ]
        summed = _all_reduce_flat(grads_in, ctx.group)
        out = [g if ctx.needs_input_grad[2 + i] else None for i, g in enumerate(summed)]
        return (None, None, *out)


class _SumGradients(torch.autograd.Function):
    """Identity forward; backward: the gradients summed over ranks (one collective)."""

    @staticmethod
    def forward(ctx, group: Any | None, *tensors: Tensor):
        ctx.group = group
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        grads_in = [
            torch.zeros(s, dtype=dt, device=dv) if g is None else g
            for g, (s, dt, dv) in zip(grads, ctx.meta, strict=False)
        ]
        return (None, *_all_reduce_flat(grads_in, ctx.group))


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, factor: float):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


def all_reduce_sum(*tensors: Tensor, group: Any | None = None, anchor: Tensor | None = None) -> list[Tensor]:
    """The sums over ranks of ``tensors`` (one ``all_reduce`` in float64), differentiable.

    Backward is the adjoint of the sum: the incoming gradients, summed over ranks (one more
    ``all_reduce``). ``anchor`` - a scalar tied to the parameters, e.g. ``0 * p.sum()`` - makes
    the outputs require a gradient even where ``tensors`` do not (an empty shard), so every
    rank runs the backward collective. Cost: ``8 sum(numel)`` bytes per call and direction.
    """
    _require_group(group)
    if anchor is not None and torch.is_grad_enabled() and anchor.requires_grad:
        return list(_AllReduceSum.apply(group, anchor, *tensors))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return list(_AllReduceSum.apply(group, None, *tensors))
    return _all_reduce_flat(tensors, group)


def sum_gradients(*tensors: Tensor, group: Any | None = None) -> list[Tensor]:
    """``tensors`` unchanged, whose gradients are summed over ranks in the backward pass."""
    _require_group(group)
    return list(_SumGradients.apply(group, *tensors))


def scale_gradient(t: Tensor, factor: float) -> Tensor:
    """``t`` unchanged, its gradient multiplied by ``factor``."""
    return _ScaleGradient.apply(t, float(factor))


def _anchor(tensors: Sequence[Tensor | None]) -> Tensor | None:
    """``0 * sum(t)`` over the tensors that require a gradient (``None`` if none does)."""
    live = [t for t in tensors if t is not None and t.requires_grad]
    if not live or not torch.is_grad_enabled():
        return None
    return sum(t.sum() for t in live) * 0.0  # type: ignore[return-value]


class ShardedEngine(KernelEngine):
    """:class:`KernelEngine` on this rank's rows whose ``M``-sized passes return global sums.

    ``kmn_k``, ``whitened_gram`` and ``column_sq_norms`` compute the shard's sum and
    all-reduce it (one collective per call, all right-hand sides at once); ``k_matmul``
    (``K_nM u``, one value per row) stays local. ``n`` is the shard's row count.
    """

    def __init__(self, kernel: Kernel, x: Tensor, centers: Tensor, *, backend: DistributedBackend, **kw: Any) -> None:
        super().__init__(kernel, x, centers, **kw)
        self.backend = backend

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    def reduce_nograd(self, t: Tensor) -> Tensor:
        """The sum over ranks of ``t`` (no autograd; one collective)."""
        return self.backend.reduce_nograd(t)

    def kmn_k(self, u: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        return self.reduce_nograd(self.local_kmn_k(u, v))

    def local_kmn_k(self, u: Tensor | None = None, v: Tensor | None = None) -> Tensor:
        """This shard's ``K_nM^T (K_nM u + v)`` (no communication)."""
        return super().kmn_k(u, v)

    def reduce_product(self, out: Tensor, anchor: Tensor | None = None) -> Tensor:
        """The differentiable sum over ranks of a product of this shard's rows."""
        return self.backend.reduce(out, anchor=anchor)[0]

    def whitened_gram(self, L: Tensor) -> Tensor:
        return self.reduce_nograd(super().whitened_gram(L))

    def column_sq_norms(self) -> Tensor:
        return self.reduce_nograd(super().column_sq_norms())


class DistributedBackend:
    """The data backend of a row-sharded run: pass it as ``FalkonOptions(backend=...)``.

    .. code-block:: python

        torch.distributed.init_process_group("gloo")          # torchrun sets the rendezvous
        x, y = my_rows_of_the_data()                           # this rank's shard
        model = FalkonGP(x, y, options=FalkonOptions(backend=DistributedBackend()))
        model.fit()                                            # alpha identical on every rank

    Each rank passes its own rows (any sizes, empty allowed); the shards in rank order form the
    global data set. Called as a builder it returns a :class:`ShardedEngine`; it also carries
    the passes of :mod:`gpfalkon.backend.passes` whose results are sums over rows (reduced
    here), :meth:`reduce` for the row sums computed outside the passes, and
    :meth:`joint_objective` for the objectives' gradients (see the module docstring).

    Args:
        group: the process group (default: the default group).
    """

    def __init__(self, group: Any | None = None) -> None:
        _require_group(group)
        self.group = group

    # ----------------------------------------------------------------- layout
    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def shard_sizes(self, x: Tensor) -> list[int]:
        """Rows per rank, in rank order (one ``all_gather`` of one integer)."""
        mine = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        sizes = [torch.zeros_like(mine) for _ in range(self.world_size)]
        _collective("all_gather of the shard sizes", lambda: dist.all_gather(sizes, mine, group=self.group))
        return [int(s) for s in sizes]

    def global_rows(self, x: Tensor) -> int:
        """The global ``n``: the sum over ranks of ``x.shape[0]``."""
        return sum(self.shard_sizes(x))

    def row_range(self, x: Tensor) -> tuple[int, int, int]:
        """``(offset, stop, n_total)``: this shard holds global rows ``offset .. stop - 1``."""
        sizes = self.shard_sizes(x)
        off = sum(sizes[: self.rank])
        return off, off + x.shape[0], sum(sizes)

    # ------------------------------------------------------------ one rank's iteration
    def _leader(self) -> int:
        """The global rank of this group's rank 0 (``torch.distributed.broadcast`` takes global ranks)."""
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def _broadcast(self, what: str, t: Tensor) -> Tensor:
        _collective(f"broadcast of {what}", lambda: dist.broadcast(t, src=self._leader(), group=self.group))
        return t

    def _broadcast_object(self, what: str, obj: Any) -> Any:
        box = [obj]
        _collective(f"broadcast of {what}", lambda: dist.broadcast_object_list(box, src=self._leader(),
                                                                              group=self.group))
        return box[0]

    def lead_solve(self, solve: Callable[[Callable[[Tensor], None]], tuple[Tensor, Any]],
                   product: Callable[[Tensor], Tensor], like: Tensor) -> tuple[Tensor, Any]:
        """An iterative solve whose ``M``-sized arithmetic runs on rank 0 alone, the data products on every rank.

        Every rank running CG's iteration itself (its residuals, steps and stopping test) stays in step only while
        the ranks' ``M``-sized arithmetic rounds alike: ranks on another BLAS or CPU drift apart (a 1e-9 relative
        difference in one rank's products moved its stopping iteration from 117 to 149), and a rank that stops
        alone leaves the others waiting in the next product's collective. Here rank 0 calls
        ``solve(announce)``; its solver calls ``announce(v)`` before each data product ``product(v)`` (one
        collective, e.g. ``K_Mn K_nM v`` summed over the shards), which sends ``v`` to the other ranks; they run
        ``product(v)`` for every ``v`` they receive, then receive rank 0's solution and info (so every rank returns
        the same, bit for bit). An exception on rank 0 is sent on and raised on every rank, a
        :class:`~gpfalkon.errors.FalkonConvergenceError` with its message (each rank's recovery, e.g. a jitter
        boost and a retry, then runs alike). ``like``: a tensor of ``v``'s shape, dtype and device. Costs two
        broadcasts a product (a flag and ``v``, ``M k`` values) and one of the solution; per-iteration callbacks
        and progress bars run on rank 0 only."""
        flag = torch.zeros(1, dtype=torch.float64, device=like.device)
        if self.rank == 0:
            def announce(v: Tensor) -> None:
                if v.shape != like.shape:
                    raise ValueError(f"lead_solve: a product of shape {tuple(v.shape)}, the followers expect "
                                     f"{tuple(like.shape)}")
                self._broadcast("the next product's flag", flag.fill_(1.0))
                self._broadcast("the next product's vectors", v.detach().to(like).contiguous().clone())

            try:
                sol, info = solve(announce)
            except BaseException as exc:
                with contextlib.suppress(Exception):  # a failed collective: the others see it fail too
                    self._broadcast("the solve's end", flag.fill_(2.0))
                    self._broadcast_object("rank 0's error", (type(exc).__name__, str(exc)))
                raise
            self._broadcast("the solve's end", flag.fill_(0.0))
            self._broadcast("the solution", sol.detach().to(like).contiguous().clone())
            self._broadcast_object("the solve's record", info)
            return sol, info
        while True:
            code = float(self._broadcast("the next product's flag", flag)[0])
            if code == 1.0:
                product(self._broadcast("the next product's vectors", torch.empty_like(like)))
            elif code == 0.0:
                sol = self._broadcast("the solution", torch.empty_like(like))
                return sol, self._broadcast_object("the solve's record", None)
            else:
                kind, message = self._broadcast_object("rank 0's error", None)
                if kind == "FalkonConvergenceError":
                    raise FalkonConvergenceError(message)
                raise DistributedError(f"rank 0's solve raised {kind}: {message}")

    # ------------------------------------------------------------ reductions
    def reduce(self, *tensors: Tensor, anchor: Tensor | None = None) -> list[Tensor]:
        """Sums over ranks (differentiable; one collective): :func:`all_reduce_sum`."""
        return all_reduce_sum(*tensors, group=self.group, anchor=anchor)

    def reduce_nograd(self, t: Tensor) -> Tensor:
        """The sum over ranks of ``t`` (no autograd; one collective)."""
        return _all_reduce_flat([t], self.group)[0]

    def gather_rows(self, x: Tensor, indices: Tensor) -> Tensor:
        """``X_global[indices]`` on every rank (``indices`` identical on every rank, checked first: ranks that drew
        different rows, e.g. with different seeds, would otherwise sum different rows into one): each rank fills the
        rows it holds, one ``all_reduce`` of ``len(indices) x d`` values (and one small ``all_gather`` for the check).
        Raises ``ValueError`` on every rank where the ranks' ``indices`` differ."""
        self.check_consistent(center_indices=indices.detach().to(torch.float64))
        off, stop, _ = self.row_range(x)
        out = torch.zeros(indices.numel(), x.shape[1], dtype=torch.float64, device=x.device)
        idx = indices.to(x.device)
        mine = (idx >= off) & (idx < stop)
        out[mine] = x[idx[mine] - off].to(torch.float64)
        return _all_reduce_flat([out], self.group)[0].to(x.dtype)

    def _device(self) -> torch.device:
        """Where small collective buffers live: the current GPU for NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def maximum(self, value: float) -> float:
        """The largest of the ranks' ``value`` (one ``all_reduce``; ``-inf`` on an empty shard is fine)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._device())
        _collective("all_reduce (max)", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group))
        return float(t[0])

    def counts(self, k: int) -> list[int]:
        """Every rank's ``k``, in rank order (one ``all_gather``)."""
        mine = torch.tensor([int(k)], dtype=torch.int64, device=self._device())
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        _collective("all_gather of a count", lambda: dist.all_gather(out, mine, group=self.group))
        return [int(c) for c in out]

    def concat(self, t: Tensor) -> Tensor:
        """The ranks' 1-D ``t`` concatenated in rank order, on every rank (float64; lengths may
        differ: padded to the longest for one ``all_gather``)."""
        sizes = self.counts(t.numel())
        width = max(max(sizes), 1)
        buf = torch.zeros(width, dtype=torch.float64, device=t.device)
        buf[: t.numel()] = t.to(torch.float64)
        out = [torch.zeros_like(buf) for _ in range(self.world_size)]
        _collective("all_gather of variable-length parts", lambda: dist.all_gather(out, buf, group=self.group))
        return torch.cat([o[:k] for o, k in zip(out, sizes, strict=False)])

    def distinct_values(self, values: Tensor) -> Tensor:
        """The sorted distinct values of ``values`` over all ranks (e.g. the class labels; one
        ``all_gather_object`` of each rank's distinct values)."""
        mine = torch.unique(values.detach()).cpu()
        everyone: list[Any] = [None] * self.world_size
        _collective("all_gather of the distinct values",
                    lambda: dist.all_gather_object(everyone, mine, group=self.group))
        return torch.unique(torch.cat([t.to(mine.dtype) for t in everyone])).to(values.device)

    # --------------------------------------------------------------- builder
    def __call__(self, kernel: Kernel, x: Tensor, centers: Tensor, **kw: Any) -> ShardedEngine:
        return ShardedEngine(kernel, x, centers, backend=self, **kw)

    # ---------------------------------------------------------------- passes
    def whitened_aggregates(self, kernel: Kernel, x: Tensor, y: Tensor, centers: Tensor, L: Tensor,
                            rows: int) -> WhitenedAggregates:
        """The in-memory pass on this shard, summed over ranks in one collective."""
        m, t = L.shape[-1], y.shape[-1]
        if x.shape[0] > 0:
            local = list(whitened_aggregates(kernel, x, y, centers, L, rows))
        else:
            z = lambda *s: torch.zeros(*s, dtype=L.dtype, device=L.device)
            local = [z(m, m), z(m, t), z(()), z(())]
        anchor = _anchor([L, centers, *kernel.parameters()])
        return WhitenedAggregates(*self.reduce(*local, anchor=anchor))

    # ------------------------------------------------------------ objectives
    def joint_objective(self, module: torch.nn.Module, fn: Callable[[], Tensor]) -> Tensor:
        """``fn()`` evaluated with ``module``'s trainable parameters passed through
        :func:`sum_gradients` and its value's gradient scaled by ``1 / world_size``: the
        parameters' gradients are then the single-process ones on every rank."""
        named = [(k, p) for k, p in module.named_parameters() if p.requires_grad]
        if not named or not torch.is_grad_enabled():
            return fn()
        synced = sum_gradients(*[p for _, p in named], group=self.group)
        params: dict[str, Tensor] = {k: s for (k, _), s in zip(named, synced, strict=False)}
        out = torch.func.functional_call(_Call(module, fn), {f"target.{k}": v for k, v in params.items()}, ())
        return scale_gradient(out, 1.0 / self.world_size)

    def check_consistent(self, **values: Tensor) -> None:
        """Raise ``ValueError`` naming the first of ``values`` that differs between ranks
        (compared by size, dtype and float64 checksums; one ``all_gather``)."""
        names = sorted(values)
        sig = []
        for k in names:
            v = values[k].detach().reshape(-1)
            sig += [float(v.numel()), float(torch.finfo(v.dtype).bits if v.is_floating_point() else -1)]
            # non-finite entries (a constraint's infinite bound) get finite codes; the position
            # weights catch permutations
            f = torch.nan_to_num(v.to(torch.float64), nan=1.5e5, posinf=2.5e5, neginf=-3.5e5)
            w = 1.0 + torch.arange(f.numel(), dtype=torch.float64, device=f.device) / max(f.numel(), 1)
            sig += [float(f.sum()), float(f.square().sum()), float((f * w).sum())]
        mine = torch.tensor(sig, dtype=torch.float64, device=next(iter(values.values())).device)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        _collective("the consistency check", lambda: dist.all_gather(everyone, mine, group=self.group))
        for r, other in enumerate(everyone):
            if not torch.equal(other, mine):
                bad = int((other != mine).nonzero()[0].item()) // 5
                what = {"cg_start": "every rank must pass the same initial_alpha and warm_start to fit()",
                        "store_format": "every rank must fit under the same gpfalkon.settings.store_format",
                        "fit_rules": "every rank must fit with the same tol, max_iter, solve_method and "
                                     "precond_dtype (fit arguments, FalkonOptions, gpfalkon.settings)",
                        "kernel_structure": "every rank must use the same kernel classes and settings (e.g. a "
                                            "Matern nu)",
                        "mean_constant": "every rank must use the same mean_constant"}.get(
                    names[bad], "every rank must build the model with the same kernel, centers, dtype and d")
                raise ValueError(
                    f"ranks disagree on {names[bad]}: rank {self.rank} and rank {r} hold different values ({what})")


class _Call(torch.nn.Module):
    """``fn()`` as a module whose parameters are ``target``'s (for ``torch.func.functional_call``)."""

    def __init__(self, target: torch.nn.Module, fn: Callable[[], Tensor]) -> None:
        super().__init__()
        self.target = target
        self._fn = fn

    def forward(self) -> Tensor:
        return self._fn()
