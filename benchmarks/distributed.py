"""Distributed FALKON (issue 13): strong scaling, all_reduce cost, a projected cost model, flights.

    python benchmarks/distributed.py                       # all parts, results/distributed.md
    python benchmarks/distributed.py --quick               # small sizes, a smoke run (not committed)

Parts (processes are spawned here, gloo on loopback, one thread each; nothing else runs at
the same time):

1. **Strong scaling**: FALKON fit of synthetic data (n = 1e6, d = 10, M = 2000, float32, RBF,
   exactly 20 CG iterations, ``K_nM`` recomputed at every pass: ``store_kernel=False`` for
   every configuration so that storage does not differ with the shard size) by 1 process
   without the distributed backend, 1 process with it, and 2 processes x 1 thread. Reported:
   fit time, speed-up over 1 process, and the time inside ``all_reduce`` (which includes waiting
   for the slower rank) per CG iteration and as a share of the fit.
2. **all_reduce latency and bandwidth**: gloo ``all_reduce`` of 8 B .. 32 MiB (float64) between
   2 processes; a least-squares fit ``t = a + bytes / b``.
3. **Cost model** (a projection, not a measurement): time per iteration and per 20-iteration
   fit at n = 1e9 on 8, 64, 512 ranks, from the measured compute per row and pass (part 1) and
   the measured ``a``, ``b`` (part 2) in an all_reduce ``2 log2(P) a + 2 (P - 1) / P * bytes / b``,
   plus the ``M x M`` work every rank repeats (measured in part 1).
4. **flights** (2,000,000 training rows, 1,000,000 test rows, d = 9): the same model (M = 2000,
   float32, fixed hyperparameters, 30 CG iterations) fitted by 1 process and by 2 processes;
   test RMSE (each rank predicts its share of the test rows; the squared errors are summed).
6. **flights, StochasticNystromCompReg**: M = 1000 learned centers on all 2,000,000 rows, seconds
   per Adam step for 1 and 2 processes.
5. **Out of core** (``--parts outofcore``, not in the default run: about 25 minutes): n = 1e8
   rows, d = 9, float32, in a .npy file read block by block by ``NpyRows``; M = 2000, 10 CG
   iterations, memory budget 2 GiB; peak RSS, wall time, test RMSE on 100,000 held-out rows.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pathlib
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, fmt, log, markdown_table, write_result

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"
CHUNK = 100_000  # rows per generator chunk: the synthetic data do not depend on the sharding


# ----------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, job: Callable, args: tuple, out: str) -> None:
    try:
        torch.set_num_threads(1)
        if world > 0:
            import gpfalkon

            gpfalkon.init_distributed("gloo", timeout_s=1800, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                      world_size=world)
        res = job(rank, max(world, 1), *args)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    except BaseException:
        with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def launch(world: int, job: Callable, args: tuple) -> list[dict[str, Any]]:
    """``job(rank, world, *args)`` on ``world`` spawned processes (``world=0``: one process
    without torch.distributed); returns each rank's JSON result."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, job, args, out)) for r in range(max(world, 1))]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        errs = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.startswith("error")]
        if errs or any(p.exitcode != 0 for p in procs):
            raise RuntimeError("workers failed:\n" + "\n".join(errs))
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(max(world, 1))]


class AllReduceTimer:
    """Counts the calls and seconds inside gpfalkon's all_reduce (monkeypatched for the run)."""

    def __init__(self) -> None:
        import gpfalkon.backend.distributed as D

        self.D = D
        self.orig = D._all_reduce_flat
        self.calls, self.seconds = 0, 0.0

        def timed(tensors, group):
            t = time.perf_counter()
            try:
                return self.orig(tensors, group)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        D._all_reduce_flat = timed

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


# ----------------------------------------------------------------------------- part 1
def synthetic_rows(start: int, stop: int, d: int) -> tuple:
    """Rows ``start .. stop - 1`` of the synthetic set (chunk-seeded: the same rows whatever the sharding)."""
    xs, ys = [], []
    for c in range(start // CHUNK, (max(stop, 1) - 1) // CHUNK + 1):
        g = torch.Generator().manual_seed(1000 + c)
        x = torch.randn(CHUNK, d, generator=g)
        y = torch.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.1 * torch.randn(CHUNK, generator=g)
        lo, hi = max(start, c * CHUNK) - c * CHUNK, min(stop, (c + 1) * CHUNK) - c * CHUNK
        if hi > lo:
            xs.append(x[lo:hi])
            ys.append(y[lo:hi])
    return (torch.cat(xs), torch.cat(ys)) if xs else (torch.zeros(0, d), torch.zeros(0))


def scaling_job(rank: int, world: int, n: int, d: int, m: int, iters: int, sharded: bool) -> dict[str, Any]:
    import gpytorch

    from gpfalkon import DistributedBackend, FalkonGP, FalkonOptions, shard_range

    start, stop = shard_range(n, rank, world)
    x, y = synthetic_rows(start, stop, d)
    backend = DistributedBackend() if sharded else None
    timer = AllReduceTimer() if sharded else None
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    with torch.no_grad():
        kernel.base_kernel.lengthscale = math.sqrt(d)
        kernel.outputscale = 1.0
    opts = FalkonOptions(backend=backend, store_kernel=False, max_iter=iters, tol=0.0)
    t0 = time.perf_counter()
    model = FalkonGP(x, y, kernel=kernel, num_centers=m, penalty=1e-6, seed=0, options=opts)
    t_build = time.perf_counter() - t0
    op = model.nystrom_operator()
    t0 = time.perf_counter()
    _ = op.preconditioner  # the M x M work every rank repeats
    t_precond = time.perf_counter() - t0
    if timer:
        timer.reset()
    t0 = time.perf_counter()
    model.fit()
    t_fit = time.perf_counter() - t0
    xq, _ = synthetic_rows(n, n + 1000, d)  # 1,000 held-out rows (beyond the training rows)
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xq).mean.double()
    out = dict(rank=rank, rows=stop - start, build_s=t_build, precond_s=t_precond, fit_s=t_fit,
               iterations=model.fit_info.iterations, alpha_norm=float(model.alpha.norm()), pred=pred.tolist())
    if timer:
        out.update(allreduce_calls=timer.calls, allreduce_s=timer.seconds)
    return out


# ----------------------------------------------------------------------------- part 2
def allreduce_job(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, Any]:
    import torch.distributed as dist

    res = {}
    for k in sizes:
        buf = torch.zeros(k, dtype=torch.float64)
        for _ in range(3):
            dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t)
        res[str(k * 8)] = float(np.median(times))
    return res


# ----------------------------------------------------------------------------- part 4
def flights_job(rank: int, world: int, m: int, iters: int, sharded: bool) -> dict[str, Any]:
    import gpytorch

    from gpfalkon import DistributedBackend, FalkonGP, FalkonOptions, shard_range

    with np.load(DATA / "flights.npz") as z:
        X, Y = z["X"], z["y"]
    perm = np.random.default_rng(0).permutation(len(Y))
    ntr = (2 * len(Y)) // 3
    tr, te = perm[:ntr], perm[ntr:]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    ym, ys = Y[tr].mean(), Y[tr].std()
    s, e = shard_range(len(tr), rank, world)
    ts, tend = shard_range(len(te), rank, world)
    x = torch.as_tensor((X[tr[s:e]] - mu) / sd, dtype=torch.float32)
    y = torch.as_tensor((Y[tr[s:e]] - ym) / ys, dtype=torch.float32)
    xt = torch.as_tensor((X[te[ts:tend]] - mu) / sd, dtype=torch.float32)
    yt = torch.as_tensor(Y[te[ts:tend]], dtype=torch.float64)
    del X, Y
    backend = DistributedBackend() if sharded else None
    timer = AllReduceTimer() if sharded else None
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5))
    with torch.no_grad():
        kernel.base_kernel.lengthscale = 1.0
        kernel.outputscale = 1.0
    opts = FalkonOptions(backend=backend, max_iter=iters, tol=0.0)
    t0 = time.perf_counter()
    model = FalkonGP(x, y, kernel=kernel, num_centers=m, penalty=1e-6, seed=0, options=opts)
    model.fit()
    t_fit = time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(xt).mean.double() * ys + ym
    sq = (pred - yt).square().sum()
    cnt = torch.tensor(float(yt.numel()), dtype=torch.float64)
    if sharded:
        sq, cnt = backend.reduce(sq, cnt)
    out = dict(rank=rank, rows=e - s, fit_s=t_fit, rmse=float((sq / cnt).sqrt()), iterations=model.fit_info.iterations)
    if timer:
        out.update(allreduce_calls=timer.calls, allreduce_s=timer.seconds)
    return out


# ----------------------------------------------------------------------------- part 6
def flights_objective_job(rank: int, world: int, m: int, steps: int, sharded: bool) -> dict[str, Any]:
    import gpytorch

    from gpfalkon import DistributedBackend, FalkonGP, FalkonOptions, shard_range
    from gpfalkon.objectives import StochasticNystromCompReg

    with np.load(DATA / "flights.npz") as z:
        X, Y = z["X"], z["y"]
    perm = np.random.default_rng(0).permutation(len(Y))
    tr = perm[: (2 * len(Y)) // 3]
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    ym, ys = Y[tr].mean(), Y[tr].std()
    s, e = shard_range(len(tr), rank, world)
    x = torch.as_tensor((X[tr[s:e]] - mu) / sd, dtype=torch.float32)
    y = torch.as_tensor((Y[tr[s:e]] - ym) / ys, dtype=torch.float32)
    del X, Y
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=x.shape[1]))
    opts = FalkonOptions(backend=DistributedBackend() if sharded else None, store_kernel=False)
    model = FalkonGP(x, y, kernel=kernel, num_centers=m, penalty=1e-5, seed=0, learn_centers=True, options=opts)
    objective = StochasticNystromCompReg(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    times, values = [], []
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad()
        loss = objective()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        values.append(float(loss.detach()))
    return dict(rank=rank, rows=e - s, step_s=times, values=values,
                cg=[int(objective.last_info.iterations)] if objective.last_info is not None else [])


# ----------------------------------------------------------------------------- part 5
OOC_D = 9


def _ooc_rows(start: int, stop: int, seed_base: int) -> tuple:
    """Rows of the out-of-core set: x ~ U(-2, 2)^9, y = f(x) + 0.1 noise (chunk-seeded)."""
    xs, ys = [], []
    for c in range(start // CHUNK, (max(stop, 1) - 1) // CHUNK + 1):
        rng = np.random.default_rng(seed_base + c)
        x = rng.uniform(-2, 2, size=(CHUNK, OOC_D)).astype(np.float32)
        f = np.sin(x[:, 0] * x[:, 1]) + 0.5 * np.cos(x[:, 2]) + 0.3 * x[:, 3] * x[:, 4] - 0.2 * x[:, 5] ** 2
        y = (f + 0.1 * rng.standard_normal(CHUNK)).astype(np.float32)
        lo, hi = max(start, c * CHUNK) - c * CHUNK, min(stop, (c + 1) * CHUNK) - c * CHUNK
        xs.append(x[lo:hi])
        ys.append(y[lo:hi])
    return np.concatenate(xs), np.concatenate(ys)


def ooc_write_job(rank: int, world: int, path: str, n: int) -> dict[str, Any]:
    """Write the ``n x 9`` float32 .npy file chunk by chunk (and y.npy next to it)."""
    t0 = time.perf_counter()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False, "shape": (n, OOC_D)}
    yh = dict(header, shape=(n,))
    with open(path, "wb") as fx, open(path + ".y.npy", "wb") as fy:
        np.lib.format.write_array_header_1_0(fx, header)
        np.lib.format.write_array_header_1_0(fy, yh)
        for s in range(0, n, CHUNK):
            x, y = _ooc_rows(s, min(n, s + CHUNK), 0)
            fx.write(x.tobytes())
            fy.write(y.tobytes())
    return dict(seconds=time.perf_counter() - t0, bytes=os.path.getsize(path))


def ooc_fit_job(rank: int, world: int, path: str, m: int, iters: int, budget: int) -> dict[str, Any]:
    import resource

    import gpytorch

    from gpfalkon import FalkonGP, FalkonOptions, NpyRows

    torch.set_num_threads(os.cpu_count() or 1)  # one process, all cores
    t0 = time.perf_counter()
    src = NpyRows(path)
    y = torch.from_numpy(np.load(path + ".y.npy"))  # n float32 targets in memory
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    with torch.no_grad():
        kernel.base_kernel.lengthscale = 1.5
        kernel.outputscale = 1.0
    opts = FalkonOptions(memory_budget=budget, max_iter=iters, tol=0.0)
    model = FalkonGP(src, y, kernel=kernel, num_centers=m, penalty=1e-7, seed=0, options=opts)
    t_build = time.perf_counter() - t0
    t1 = time.perf_counter()
    model.fit()
    t_fit = time.perf_counter() - t1
    xt, yt = _ooc_rows(0, 100_000, 10_000_000)  # held out: other seeds than the training chunks
    model.eval()
    with torch.no_grad(), gpytorch.settings.skip_posterior_variances():
        pred = model(torch.from_numpy(xt)).mean.double().numpy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return dict(rows=len(src), build_s=t_build, fit_s=t_fit, iterations=model.fit_info.iterations,
                rmse=float(np.sqrt(np.mean((pred - yt) ** 2))), y_rms=float(np.sqrt(np.mean(yt**2))), peak_rss_gib=peak)


# ----------------------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--parts", nargs="+", default=["scaling", "allreduce", "flights", "objective"],
                    help="scaling allreduce flights objective outofcore")
    ap.add_argument("--out", default="benchmarks/results/distributed.md")
    ap.add_argument("--ooc-rows", type=int, default=100_000_000, help="rows of the out-of-core part")
    ap.add_argument("--ooc-dir", default=None, help="directory for the out-of-core file (default: the temp dir)")
    args = ap.parse_args()
    env = environment_lines()
    n, d, m, iters = (100_000, 10, 500, 5) if args.quick else (1_000_000, 10, 2000, 20)
    body: list[str] = []
    scaling: dict[str, Any] = {}
    ar_fit: tuple | None = None

    if "scaling" in args.parts:
        log(f"strong scaling: n={n:,} d={d} M={m} {iters} iterations")
        runs = {"1 process (in-memory backend)": launch(0, scaling_job, (n, d, m, iters, False)),
                "1 process (DistributedBackend)": launch(1, scaling_job, (n, d, m, iters, True)),
                "2 processes (DistributedBackend)": launch(2, scaling_job, (n, d, m, iters, True))}
        base = runs["1 process (in-memory backend)"][0]["fit_s"]
        ref_pred = np.array(runs["1 process (in-memory backend)"][0]["pred"])
        rows = []
        for name, res in runs.items():
            pred_diff = float(np.abs(np.array(res[0]["pred"]) - ref_pred).max() / np.abs(ref_pred).max())
            fit = max(r["fit_s"] for r in res)
            ar = [r.get("allreduce_s") for r in res]
            ar_s = max(a for a in ar) if ar[0] is not None else None
            calls = res[0].get("allreduce_calls")
            rows.append([name, ", ".join(f"{r['rows']:,}" for r in res), fmt(fit), fmt(base / fit),
                         fmt(max(r["precond_s"] for r in res)), "-" if calls is None else str(calls),
                         "-" if ar_s is None else fmt(1000 * ar_s / max(res[0]["iterations"] + 1, 1)),
                         "-" if ar_s is None else f"{100 * ar_s / fit:.2f} %",
                         f"{res[0]['alpha_norm']:.6g}", f"{pred_diff:.2e}"])
            log(f"  {name}: fit {fit:.2f} s")
        scaling = dict(base=runs["1 process (in-memory backend)"][0], two=runs["2 processes (DistributedBackend)"])
        body.append("## 1. Strong scaling\n")
        body.append(f"Synthetic data n = {n:,}, d = {d}, M = {m}, float32, RBF, {iters} CG iterations (tol 0), "
                    "K_nM recomputed at every pass; one thread per process. Fit s is the slowest rank's "
                    "`FalkonGP.fit()` (the `kmn_y` pass, the preconditioner and the CG iterations); all_reduce ms "
                    "per pass and share are the slowest rank's time inside `all_reduce` (including waiting for "
                    "the other rank). ||alpha|| and 'prediction diff' "
                    "(max |mean - 1-process mean| / max |1-process mean| "
                    "on 1,000 held-out rows) show that the runs solve the same system: in float32 the shards' block "
                    "sums round differently, which CG at lambda = 1e-6 and tol 0 carries into alpha's "
                    "small-eigenvalue directions (tests/test_distributed.py checks 1e-10 agreement in float64).\n")
        body.append(markdown_table(["configuration", "rows per rank", "fit s", "speed-up", "preconditioner s",
                                    "all_reduce calls", "all_reduce ms / pass", "all_reduce share", "||alpha||",
                                    "prediction diff"], rows))

    if "allreduce" in args.parts:
        sizes = [1, 16, 256, 4096, 65536, 1 << 20] + ([] if args.quick else [4 << 20])
        log("all_reduce latency / bandwidth")
        res = launch(2, allreduce_job, (sizes, 5 if args.quick else 20))[0]
        b = np.array([float(k) for k in res])
        t = np.array([res[k] for k in res])
        # latency: the smallest message; bandwidth: the largest one beyond that latency
        lat = float(t[np.argmin(b)])
        inv_bw = max(float((t[np.argmax(b)] - lat) / b.max()), 1e-15)
        ar_fit = (lat, 1.0 / inv_bw)
        body.append("\n## 2. all_reduce (gloo, 2 processes, loopback)\n")
        body.append(markdown_table(["bytes", "median s"], [[f"{int(k):,}", f"{v:.3g}"] for k, v in res.items()]))
        body.append(f"\nModel `t = a + bytes / b`: latency a = {1e6 * lat:.1f} us (the {int(b.min())}-byte message), "
                    f"bandwidth b = {1e-9 / inv_bw:.2f} GB/s (the {int(b.max()):,}-byte message beyond a) "
                    "(loopback on this machine; a network between machines has a higher latency and usually a "
                    "lower bandwidth).\n")

    if scaling and ar_fit is not None:
        base = scaling["base"]
        passes = base["iterations"] + 1
        per_row = (base["fit_s"] - base["precond_s"]) / (passes * n)
        lat, bw = ar_fit
        msg = m * 8  # one M x 1 float64 vector per pass
        rows = []
        N = 1e9
        for P in (8, 64, 512):
            comp = N / P * per_row
            ar = 2 * math.ceil(math.log2(P)) * lat + 2 * (P - 1) / P * msg / bw
            it = comp + ar
            rows.append([str(P), f"{N / P:,.0f}", fmt(comp), f"{1e3 * ar:.3g}", fmt(it),
                         fmt(passes * it + base["precond_s"]), f"{100 * ar / it:.3f} %"])
        body.append("\n## 3. Cost model at n = 1e9 (a projection, not a measurement)\n")
        body.append(f"Compute per row and pass {1e9 * per_row:.1f} ns (part 1, 1 process, one thread, M = {m}, "
                    f"d = {d}, float32, K_nM recomputed); all_reduce of one M-vector ({msg:,} bytes) modelled as "
                    "`2 log2(P) a + 2 (P - 1) / P bytes / b` (recursive halving-doubling; a plain ring has "
                    f"`2 (P - 1)` latency steps) with the loopback a and b of part 2; {passes} passes per fit plus "
                    "the preconditioner "
                    f"({base['precond_s']:.2f} s, repeated on every rank). Assumes one thread per rank and the "
                    "loopback network: multiply the all_reduce column by the ratio of a real network's latency.\n")
        body.append(markdown_table(["ranks", "rows per rank", "compute s / pass", "all_reduce ms / pass",
                                    "s / pass", f"s / fit ({passes} passes)", "all_reduce share"], rows))
        bcast = 2 * 8 * m * m
        body.append(f"\nThe M x M work is repeated on every rank rather than done on one and broadcast: its wall time "
                    f"({base['precond_s']:.2f} s here) is the same either way, and broadcasting the two float64 "
                    f"factors ({bcast / 2**20:.0f} MiB) would add about {1e3 * (lat + bcast / bw):.0f} ms at the "
                    "loopback bandwidth above.\n")

    if "flights" in args.parts and not args.quick:
        log("flights: 1 vs 2 processes")
        one = launch(0, flights_job, (2000, 30, False))[0]
        two = launch(2, flights_job, (2000, 30, True))
        fit2 = max(r["fit_s"] for r in two)
        body.append("\n## 4. flights, 1 vs 2 processes\n")
        body.append("2,000,000 training rows (random 2/3, seed 0), 1,000,000 test rows, d = 9, standardised; "
                    "Matern-5/2 (lengthscale 1, outputscale 1), lambda = 1e-6, M = 2000 uniform centers (seed 0), "
                    "float32, 30 CG iterations (tol 0); fit s includes building the model (center selection). "
                    "Each rank predicts its share of the test rows.\n")
        body.append(markdown_table(["configuration", "rows per rank", "fit s", "speed-up", "test RMSE (minutes)",
                                    "all_reduce s"],
                                   [["1 process", f"{one['rows']:,}", fmt(one["fit_s"]), "1",
                                     f"{one['rmse']:.6f}", "-"],
                                    ["2 processes", ", ".join(f"{r['rows']:,}" for r in two), fmt(fit2),
                                     fmt(one["fit_s"] / fit2), f"{two[0]['rmse']:.6f}",
                                     fmt(max(r["allreduce_s"] for r in two))]]))
    if "objective" in args.parts and not args.quick:
        log("flights: StochasticNystromCompReg steps, 1 vs 2 processes")
        steps = 3
        one = launch(0, flights_objective_job, (1000, steps, False))[0]
        two = launch(2, flights_objective_job, (1000, steps, True))
        rows = [["1 process", f"{one['rows']:,}", ", ".join(f"{t:.1f}" for t in one["step_s"]),
                 fmt(float(np.median(one["step_s"]))), "1", ", ".join(f"{v:.6g}" for v in one["values"])],
                ["2 processes", ", ".join(f"{r['rows']:,}" for r in two),
                 ", ".join(f"{max(r['step_s'][i] for r in two):.1f}" for i in range(steps)),
                 fmt(float(np.median([max(r["step_s"][i] for r in two) for i in range(steps)]))),
                 fmt(float(np.median(one["step_s"])) / float(np.median([max(r["step_s"][i] for r in two)
                                                                        for i in range(steps)]))),
                 ", ".join(f"{v:.6g}" for v in two[0]["values"])]]
        body.append("\n## 6. flights: StochasticNystromCompReg with learned centers, 1 vs 2 processes\n")
        body.append("All 2,000,000 training rows, M = 1000 learned centers (uniform start, seed 0), Matern-5/2 ARD, "
                    "float32, K_nM recomputed (store_kernel=False for both), the objective's defaults (20 trace "
                    f"vectors, CG to 1e-4 or 50 iterations, warm-started), Adam lr 0.05, {steps} steps; a step is "
                    "objective + backward + optimizer step (2 processes: the slower rank). The objective values "
                    "show both runs follow the same path.\n")
        body.append(markdown_table(["configuration", "rows per rank", "s per step", "median s / step", "speed-up",
                                    "objective values"], rows))

    if "outofcore" in args.parts:
        n_ooc = 1_000_000 if args.quick else args.ooc_rows
        iters_ooc = 3 if args.quick else 10
        budget = 2 * 2**30
        with tempfile.TemporaryDirectory(dir=args.ooc_dir) as tmp:
            path = os.path.join(tmp, "x.npy")
            log(f"out of core: writing {n_ooc:,} x {OOC_D} float32 rows to {path}")
            w = launch(0, ooc_write_job, (path, n_ooc))[0]
            log(f"  written {w['bytes'] / 2**30:.2f} GiB in {w['seconds']:.0f} s; fitting")
            r = launch(0, ooc_fit_job, (path, 2000, iters_ooc, budget))[0]
        body.append("\n## 5. Out of core (rows read from disk, block by block)\n")
        body.append(f"n = {n_ooc:,} rows, d = {OOC_D}, float32 in one .npy file ({w['bytes'] / 2**30:.2f} GiB, "
                    "written chunk by chunk by another process), read by `NpyRows` (positioned reads, no memory "
                    f"map); y ({n_ooc:,} float32) in memory. x ~ U(-2, 2)^9, y = sin(x1 x2) + 0.5 cos(x3) + "
                    "0.3 x4 x5 - 0.2 x6^2 + 0.1 N(0, 1). RBF (lengthscale 1.5), lambda = 1e-7, M = 2000, "
                    f"{iters_ooc} CG iterations (tol 0), memory budget {budget / 2**30:.0f} GiB, one process with 2 "
                    "threads. Peak RSS is the fitting process's maximum resident set (ru_maxrss), data loading "
                    "included. Test RMSE on 100,000 held-out rows (noise standard deviation 0.1).\n")
        body.append(markdown_table(["rows", "peak RSS GiB", "build s (checks, centers)", "fit s", "CG iterations",
                                    "s / pass", "test RMSE", "RMS of y"],
                                   [[f"{r['rows']:,}", f"{r['peak_rss_gib']:.2f}", fmt(r["build_s"]), fmt(r["fit_s"]),
                                     str(r["iterations"]), fmt(r["fit_s"] / (r["iterations"] + 1)),
                                     f"{r['rmse']:.4f}", f"{r['y_rms']:.4f}"]]))
    path = write_result(pathlib.Path(args.out), "Distributed FALKON (torch.distributed, gloo)", env, "\n".join(body))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
