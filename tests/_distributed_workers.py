"""Worker code for tests/test_distributed.py: runs in spawned processes (gloo on loopback).

Every worker builds the same data set from one seed, keeps the rows of its shard, and saves
what it computed to ``<out>/rank<r>.pt``; the test compares with a single process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import gpfalkon
from gpfalkon import FalkonGP, FalkonOptions
from gpfalkon.backend.distributed import DistributedBackend
from gpfalkon.objectives import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound

N, D, M = 240, 3, 30
OBJECTIVES = {"sgpr": SGPRBound, "gcv": GCV, "compreg": CompReg, "nystrom-compreg": NystromCompReg, "loocv": LOOCV,
              "holdout": HoldOut}
COMPARED = [*OBJECTIVES, "stochastic-subsample", "stochastic-hutchinson"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data(n: int = N, d: int = D, outputs: int = 1, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(7)
    x = torch.rand(n, d, generator=g, dtype=dtype) * 4 - 2
    f = torch.sin(2 * x[:, :1]) + 0.5 * torch.cos(3 * x[:, 1:2]) * x[:, -1:]
    y = f + 0.1 * torch.randn(n, outputs, generator=g, dtype=dtype)
    xt = torch.rand(17, d, generator=g, dtype=dtype) * 4 - 2
    return x, (y[:, 0] if outputs == 1 else y), xt


def shard_bounds(sizes: Sequence[int]) -> list[tuple]:
    out, s = [], 0
    for k in sizes:
        out.append((s, s + k))
        s += k
    return out


def make_kernel(d: int = D, dtype: torch.dtype = torch.float64):
    k = gpytorch_kernel(d).to(dtype)
    with torch.no_grad():
        k.base_kernel.lengthscale = torch.linspace(0.7, 1.3, d, dtype=dtype).reshape(1, d)
        k.outputscale = torch.tensor(1.3, dtype=dtype)
    return k


def gpytorch_kernel(d: int):
    from gpytorch.kernels import MaternKernel, ScaleKernel

    return ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d))


def build(x, y, backend=None, learn_centers: bool = True, **kw) -> FalkonGP:
    opts = FalkonOptions(backend=backend, tol=1e-12, max_iter=500)
    return FalkonGP(x, y, make_kernel(x.shape[1], x.dtype), num_centers=M, penalty=1e-3, learn_centers=learn_centers,
                    seed=3, options=opts, **kw)


def probes(n: int = N, r: int = 4) -> torch.Tensor:
    """Fixed trace vectors Z (n x r) for the stochastic objective."""
    return torch.randn(n, r, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def model_results(model: FalkonGP, xt: torch.Tensor, rows: slice | None = None) -> dict[str, Any]:
    """alpha, centers, predictions and every objective's value and gradients (``rows``: this
    process's rows of the global data, for the stochastic objective's probe vectors)."""
    rows = slice(None) if rows is None else rows
    out: dict[str, Any] = {"centers": model.centers.detach().clone(), "n": model.n}
    model.fit()
    out["alpha"] = model.alpha.clone()
    out["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}  # saved right after the fit
    model.eval()
    with torch.no_grad():
        pred = model(xt)
        out["mean"], out["var"] = pred.mean.clone(), pred.variance.clone()
    model.train()
    for name, cls in OBJECTIVES.items():
        obj = cls(model)
        model.zero_grad()
        loss = obj()
        loss.backward()
        out[f"{name}/value"] = loss.detach().clone()
        out[f"{name}/grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    from gpfalkon.objectives import StochasticNystromCompReg

    for trace in ("subsample", "hutchinson"):
        obj = StochasticNystromCompReg(model, trace_vectors=probes()[rows], ktilde_trace=trace, subsample_size=50,
                                       cg_iterations=400, cg_tol=1e-13, warm_start=False)
        model.zero_grad()
        loss = obj()
        loss.backward()
        out[f"stochastic-{trace}/value"] = loss.detach().clone()
        out[f"stochastic-{trace}/grads"] = {k: p.grad.detach().clone() for k, p in model.named_parameters()
                                            if p.grad is not None}
    # three Adam steps on the SGPR bound: every rank must end with the same parameters
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    obj = SGPRBound(model)
    for _ in range(3):
        opt.zero_grad()
        obj().backward()
        opt.step()
    out["after_adam"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


def single_process_results(outputs: int = 1) -> dict[str, Any]:
    x, y, xt = data(outputs=outputs)
    return model_results(build(x, y), xt)


def _fit_and_save(rank: int, world: int, sizes: Sequence[int], out_dir: str, outputs: int) -> None:
    x, y, xt = data(outputs=outputs)
    s, e = shard_bounds(sizes)[rank]
    model = build(x[s:e], y[s:e], DistributedBackend())
    res = model_results(model, xt, slice(s, e))
    if rank != 0:  # the state_dict of rank 0 is the one saved (for a single-process load)
        res.pop("state_dict")
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _classifier_and_save(rank: int, world: int, sizes: Sequence[int], out_dir: str) -> None:
    from gpfalkon import FalkonClassifier

    x, labels, xt = class_data()
    s, e = shard_bounds(sizes)[rank]
    clf = FalkonClassifier(x[s:e], labels[s:e], make_kernel(), num_centers=M, penalty=1e-3, seed=3,
                           options=FalkonOptions(backend=DistributedBackend(), tol=1e-12, max_iter=500)).fit()
    torch.save({"alpha": clf.model.alpha.clone(), "classes": clf.classes.clone(), "scores": clf.decision_function(xt)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def class_data():
    x, _, xt = data()
    labels = torch.bucketize(x[:, 0] + 0.3 * x[:, 1], torch.tensor([-0.5, 0.5], dtype=x.dtype)) * 10
    return x, labels, xt


def _source_and_save(rank: int, world: int, path: str, out_dir: str) -> None:
    """Each rank reads its balanced shard of one .npy file (gpfalkon.shard_rows)."""
    from gpfalkon import NpyRows, shard_rows

    _x, y, xt = data()
    src = shard_rows(NpyRows(path))
    s, e = gpfalkon.shard_range(N)
    model = build(src, y[s:e], DistributedBackend(), learn_centers=False)
    model.fit()
    model.eval()
    with torch.no_grad():
        pred = model(xt)
    torch.save({"alpha": model.alpha.clone(), "mean": pred.mean.clone(), "var": pred.variance.clone()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def leverage_model(x, y, backend=None) -> FalkonGP:
    return FalkonGP(x, y, make_kernel(), num_centers=M, penalty=1e-3, center_selection="leverage", seed=5,
                    leverage_options={"min_dictionary_size": 16},
                    options=FalkonOptions(backend=backend, tol=1e-12, max_iter=500))


def _leverage_and_save(rank: int, world: int, sizes: Sequence[int], out_dir: str, repeated: bool = False) -> None:
    x, y = repeated_data() if repeated else data()[:2]
    s, e = shard_bounds(sizes)[rank]
    model = leverage_model(x[s:e], y[s:e], DistributedBackend()).fit()
    torch.save(
        {"centers": model.centers.clone(), "weights": model.center_weights.clone(), "alpha": model.alpha.clone()},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


def repeated_data() -> tuple[torch.Tensor, torch.Tensor]:
    """``data()``'s inputs rounded to a coarse grid: many rows repeat (distinct centers must skip them)."""
    x, y, _ = data()
    return torch.round(x), y


def _distinct_centers_and_save(rank: int, world: int, sizes: Sequence[int], out_dir: str) -> None:
    x, _ = repeated_data()
    s, e = shard_bounds(sizes)[rank]
    sel = gpfalkon.uniform_centers(x[s:e], M, torch.Generator().manual_seed(3), backend=DistributedBackend())
    torch.save({"centers": sel.centers.clone(), "indices": sel.indices.clone()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _inconsistent(rank: int, world: int, out_dir: str, what: str) -> None:
    x, y, _ = data()
    s, e = shard_bounds([N // 2, N - N // 2])[rank]
    k = make_kernel()
    if rank == 1 and what == "kernel":
        with torch.no_grad():
            k.base_kernel.lengthscale = k.base_kernel.lengthscale * 2
    if rank == 1 and what == "d":
        x = torch.cat([x, x[:, :1]], 1)
        k = make_kernel(D + 1)
    if rank == 1 and what == "nu":  # another Matern: same parameters, another kernel
        k.base_kernel.nu = 1.5
    if rank == 1 and what == "nan":
        x = x.clone()
        x[s + 3, 1] = float("nan")
    kw: dict = dict(num_centers=M, seed=3)
    if rank == 1 and what == "mean_constant":
        kw["mean_constant"] = 1.0
    if rank == 1 and what == "seed":  # each rank would draw other rows as centers
        kw["seed"] = 4
    if rank == 1 and what == "num_centers":
        kw["num_centers"] = M + 1
    if rank == 1 and what == "max_iter":
        kw["max_iter"] = 3
    if rank == 1 and what == "learn_centers":
        kw["learn_centers"] = True
    xs = x[s:e]
    if what == "source_rewritten":  # each rank's rows in a .npy file; rank 1's rewritten before fit()
        import numpy as np

        from gpfalkon.backend.sources import NpyRows

        path = os.path.join(out_dir, f"x{rank}.npy")
        np.save(path, xs.numpy())
        xs = NpyRows([path])
    try:
        model = FalkonGP(xs, y[s:e], k, **kw, options=FalkonOptions(backend=DistributedBackend()))
        if what == "source_rewritten":
            if rank == 1:
                st = os.stat(path)
                np.save(path, x[s:e].numpy() * 0.5)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
            model.fit()
        if what.startswith("initial_alpha"):  # a CG start given on one rank only, or different ones
            start = torch.zeros_like(model.alpha) if rank == 0 or what == "initial_alpha" else None
            if start is not None and rank == 1:
                start += 1.0
            model.fit(initial_alpha=start)
        if what == "store_format":  # K_nM stored in 16-bit fixed point on rank 1 only
            with gpfalkon.settings.store_format("int16" if rank == 1 else None):
                model.fit()
        if what == "fit_tol":  # CG would stop at different iterations (a collective left waiting)
            model.fit(tol=1e-3 if rank == 1 else None)
        if what == "solve_method":  # one rank direct, the other CG (an abort inside gloo)
            model.options = model.options.replace(solve_method="direct" if rank == 1 else "cg")
            model.fit()
        if what == "settings_tol":
            with gpfalkon.settings.cg_tolerance(1e-3 if rank == 1 else 1e-8):
                model.fit()
        if what == "nu_after":  # the kernel changed on one rank after construction
            if rank == 1:
                model.kernel.base_kernel.nu = 1.5
            model.fit()
        if what.startswith("objective_"):  # a hyperparameter changed on one rank after construction, then a step
            from gpfalkon.objectives import GCV, SGPRBound

            if rank == 1:
                with torch.no_grad():
                    model.kernel.base_kernel.lengthscale = model.kernel.base_kernel.lengthscale * 2
            (SGPRBound if what == "objective_sgpr" else GCV)(model)().backward()
        msg = "no error"
    except ValueError as exc:
        msg = str(exc)
    torch.save({"message": msg}, os.path.join(out_dir, f"rank{rank}.pt"))


def start_of(model: FalkonGP) -> torch.Tensor:
    """A deterministic CG start of ``model.alpha``'s shape (the same on every rank)."""
    return torch.linspace(-1.0, 1.0, model.alpha.numel(), dtype=torch.float64).reshape(model.alpha.shape)


def _started(rank: int, world: int, out_dir: str, mode: str) -> None:
    """``fit(initial_alpha=...)`` with rows sharded: ``"same"`` start on every rank (saved: alpha and CG's
    residuals), or ``"invalid"`` on rank 1 only (NaN; rank 0 passes a valid one): every rank raises;
    ``"int16"``: the same start, every rank under ``gpfalkon.settings.store_format("int16")``."""
    x, y, _ = data()
    s, e = shard_bounds([N // 2, N - N // 2])[rank]
    model = FalkonGP(x[s:e], y[s:e], make_kernel(), num_centers=M, seed=3, penalty=1e-4, max_iter=7, tol=0.0,
                     options=FalkonOptions(backend=DistributedBackend(), solve_method="cg"))
    start = start_of(model)
    if mode == "invalid" and rank == 1:
        start = torch.full_like(start, float("nan"))
    try:
        with gpfalkon.settings.store_format("int16" if mode == "int16" else None):
            model.fit(initial_alpha=start)
        res = {"alpha": model.alpha, "residuals": model.fit_info.residuals, "message": "no error"}
    except ValueError as exc:
        res = {"message": str(exc)}
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _approximate_variances(rank: int, world: int, out_dir: str) -> None:
    """Rows sharded over the ranks; after the fit only rank 0 asks for predictive variances under
    ``gpfalkon.settings.variance_factors("approximate")`` (formed from ``K_MM`` alone: no collective, so
    rank 1 does not take part), then every rank meets in the final barrier."""
    x, y, xt = data()
    s, e = shard_bounds([N // 2, N - N // 2])[rank]
    model = FalkonGP(x[s:e], y[s:e], make_kernel(), num_centers=M, seed=3, penalty=1e-4,
                     options=FalkonOptions(backend=DistributedBackend()))
    model.fit()
    if rank == 0:
        model.eval()
        with torch.no_grad(), gpfalkon.settings.variance_factors("approximate"):
            var = model(xt).variance
        torch.save({"var": var, "alpha": model.alpha}, os.path.join(out_dir, "rank0.pt"))


def _mixed_storage(rank: int, world: int, sizes: Sequence[int], m: int, budget: int, out_dir: str) -> None:
    """Shards of unequal size under one memory budget: one rank stores its K_nM, the other
    does not; ``solve_method="auto"`` must still take one method on every rank."""
    x, y, _ = data(n=sum(sizes))
    s, e = shard_bounds(sizes)[rank]
    model = FalkonGP(x[s:e], y[s:e], make_kernel(), num_centers=m, seed=3, penalty=1e-3,
                     options=FalkonOptions(backend=DistributedBackend(), memory_budget=budget))
    op = model.nystrom_operator()
    stored = op.engine.stored
    model.fit()
    torch.save({"alpha": model.alpha, "stored": stored, "method": model.fit_info.extra.get("method", "cg")},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _float32_direct(rank: int, world: int, sizes: Sequence[int], out_dir: str) -> None:
    """float32 shards solved directly: the system's float64 passes (right-hand side and whitened Gram matrix) are
    summed over the ranks like the data dtype's."""
    x, y, _ = data(n=sum(sizes), dtype=torch.float32)
    s, e = shard_bounds(sizes)[rank]
    model = FalkonGP(x[s:e], y[s:e], make_kernel(dtype=torch.float32), centers=x[:60].clone(), penalty=1e-6,
                     options=FalkonOptions(backend=DistributedBackend(), solve_method="direct")).fit()
    torch.save({"alpha": model.alpha, "method": model.fit_info.extra.get("method")},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _heterogeneous(rank: int, world: int, out_dir: str) -> None:
    """Rank 1's M-sized arithmetic rounds differently (its preconditioner's products perturbed in the ninth digit,
    as another BLAS or CPU might): CG's iteration runs on rank 0 alone, so both ranks take rank 0's iterations and
    return its solution, the single-process one."""
    from gpfalkon import FalkonPreconditioner

    if rank == 1:
        original = FalkonPreconditioner.apply_bt

        def perturbed(self, u):
            out = original(self, u)
            return out * (1 + 1e-9 * torch.cos(torch.arange(out.shape[0], dtype=out.dtype)).unsqueeze(-1))

        FalkonPreconditioner.apply_bt = perturbed
    x, y, _ = data(n=300)
    s, e = shard_bounds([130, 170])[rank]
    model = FalkonGP(x[s:e], y[s:e], make_kernel(), centers=x[:40].clone(), penalty=1e-6, tol=1e-10, max_iter=400,
                     options=FalkonOptions(backend=DistributedBackend(), solve_method="cg")).fit()
    torch.save({"alpha": model.alpha, "iterations": model.fit_info.iterations},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _lead_solve_protocol(rank: int, world: int, out_dir: str) -> None:
    """``DistributedBackend.lead_solve`` directly: rank 0's solve announces three products, which every rank runs
    (an all-reduce each), and returns; then a solve that raises FalkonConvergenceError after one product."""
    from gpfalkon.errors import FalkonConvergenceError

    backend = DistributedBackend()
    like = torch.zeros(4, 2, dtype=torch.float64)
    seen: list[torch.Tensor] = []

    def product(v):
        seen.append(v.clone())
        return backend.reduce_nograd(v * (rank + 1))

    def solve(announce):
        sums = []
        for j in range(3):
            v = torch.full((4, 2), float(j + 1), dtype=torch.float64)
            announce(v)
            sums.append(product(v))
        return sums[-1], {"products": 3, "sums": [float(t[0, 0]) for t in sums]}

    sol, info = backend.lead_solve(solve, product, like)

    def failing(announce):
        announce(torch.ones(4, 2, dtype=torch.float64))
        product(torch.ones(4, 2, dtype=torch.float64))
        raise FalkonConvergenceError("CG lost positive definiteness at iteration 1 (test)")

    try:
        backend.lead_solve(failing, product, like)
        error = None
    except FalkonConvergenceError as exc:
        error = str(exc)
    torch.save({"sol": sol, "info": info, "seen": [float(v[0, 0]) for v in seen], "error": error},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _fixed_store_empty_shard(rank: int, world: int, out_dir: str) -> None:
    """An int16 K_nM store with rank 1's shard empty (it stores nothing): every rank must still take the
    preconditioner of the store's resolution, or the ranks' CG would run on different systems."""
    from gpfalkon import settings

    x, y, _ = data(n=400)
    xs, ys = (x, y) if rank == 0 else (x[:0], y[:0])
    with settings.store_format("int16"):
        model = FalkonGP(xs, ys, make_kernel(), centers=x[:40].clone(), penalty=1e-6, tol=1e-9, max_iter=300,
                         options=FalkonOptions(backend=DistributedBackend(), solve_method="cg", store_kernel=True))
        jitter = model.nystrom_operator()._precond_jitter()
        model.fit()
    torch.save({"alpha": model.alpha, "jitter": jitter}, os.path.join(out_dir, f"rank{rank}.pt"))


def _killed(rank: int, world: int, out_dir: str) -> None:
    import time

    x, y, _ = data()
    s, e = shard_bounds([N // 2, N - N // 2])[rank]
    if rank == 1:
        os._exit(3)  # a rank that dies without a word
    t0 = time.perf_counter()
    try:
        FalkonGP(x[s:e], y[s:e], make_kernel(), num_centers=M, seed=3,
                 options=FalkonOptions(backend=DistributedBackend())).fit()
        msg, kind = "no error", None
    except Exception as exc:
        msg, kind = str(exc), type(exc).__name__
    torch.save({"message": msg, "type": kind, "seconds": time.perf_counter() - t0},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _entry(rank: int, world: int, port: int, job: Callable[..., None], args: tuple, out_dir: str,
           timeout_s: float, final_barrier: bool) -> None:
    import faulthandler
    import sys

    # a fatal signal (SIGABRT from a C++ terminate, SIGSEGV) leaves the Python stacks of every thread
    # in fault<r>.txt, which the parent prints: a crash is diagnosable, not only an exit code
    fault_log = open(os.path.join(out_dir, f"fault{rank}.txt"), "w")
    faulthandler.enable(file=fault_log, all_threads=True)
    try:
        gpfalkon.init_distributed("gloo", timeout_s=timeout_s, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                  world_size=world)
        torch.set_num_threads(1)
        job(rank, world, *args)
        # every rank done with its collectives before any tears its connections down: a rank that
        # destroys its gloo group while a peer still completes its last collective can make that
        # peer abort (SIGABRT, seen once in CI on the 3-rank test)
        if final_barrier:
            dist.barrier()
    except BaseException:  # the parent reads the traceback
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_CONTEXT: list[Any] = []


def _context() -> Any:
    """The ``forkserver`` start method, its server importing torch, gpytorch and gpfalkon once: each rank is forked
    from it (a fresh interpreter with the job's module imported, as under ``spawn``, without paying those imports in
    every process of every test). Where the platform has no forkserver, ``spawn``."""
    if not _CONTEXT:
        try:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "gpytorch", "gpfalkon"])
        except ValueError:
            ctx = mp.get_context("spawn")
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def run(world: int, job: Callable[..., None], args: tuple, out_dir: str, timeout_s: float = 60.0,
        deadline_s: float = 300.0, allow_exit: Sequence[int] = (), final_barrier: bool = True) -> list[int]:
    """``job(rank, world, *args)`` in ``world`` spawned processes (gloo on loopback, collective
    timeout ``timeout_s``); returns the exit codes. Raises with the ranks' tracebacks if a rank
    not in ``allow_exit`` failed, or if any is still running after ``deadline_s``. ``final_barrier``:
    the ranks meet in a barrier after the job (off for jobs where a rank dies on purpose)."""
    port = free_port()
    ctx = _context()
    procs = [
        ctx.Process(target=_entry, args=(r, world, port, job, args, out_dir, timeout_s, final_barrier))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    import time

    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    codes = [p.exitcode for p in procs]
    failed = [r for r, c in enumerate(codes) if c != 0 and r not in allow_exit]
    if hung or failed:
        msgs = [f"ranks still running after {deadline_s} s: {hung}"] if hung else []
        for r in range(world):
            for name in (f"error{r}.txt", f"fault{r}.txt"):
                path = os.path.join(out_dir, name)
                if os.path.exists(path) and os.path.getsize(path):
                    msgs.append(f"rank {r} ({name}):\n" + open(path).read())
        raise AssertionError(f"distributed workers failed (exit codes {codes}):\n" + "\n".join(msgs))
    return codes


__all__ = ["build", "data", "gpfalkon", "run", "shard_bounds", "single_process_results"]
