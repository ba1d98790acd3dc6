"""FalkonGP on several processes (torch.distributed): each rank holds a shard of the rows.

    torchrun --nproc-per-node 2 examples/distributed_fit.py                 # one machine, 2 ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint HOST:29500 --rdzv-id job1 examples/distributed_fit.py   # on each of 2 machines

Each rank reads its contiguous shard of the protein training rows (embedded in data/), the
model code is the single-process code with ``FalkonOptions(backend=DistributedBackend())``:
``fit()`` sums every pass over the rows across ranks (one ``all_reduce`` per CG iteration),
the centers are drawn over the global rows, ``--learn`` steps of the SGPR bound give every
rank the single-process gradients. Rank 0 prints the test RMSE; ``--check`` also fits one
process on all rows and prints the largest difference of ``alpha`` (float64: ~1e-12).
"""
from __future__ import annotations

import argparse
import pathlib
import time

import gpytorch
import numpy as np
import torch
import torch.distributed as dist

import gpfalkon
from gpfalkon import DistributedBackend, FalkonGP, FalkonOptions, shard_range
from gpfalkon.objectives import SGPRBound

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "protein.npz"


def load(split: int, dtype: torch.dtype, limit: int | None):
    with np.load(DATA) as z:
        X, y, mask = z["X"], z["y"], z["test_mask"][:, split]
    xtr, ytr, xte, yte = (torch.as_tensor(a, dtype=dtype) for a in (X[~mask], y[~mask], X[mask], y[mask]))
    if limit is not None:
        xtr, ytr = xtr[:limit], ytr[:limit]
    return xtr, ytr, xte, yte


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--centers", type=int, default=2000)
    ap.add_argument("--penalty", type=float, default=5e-6)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    ap.add_argument("--iterations", type=int, default=100, help="maximum CG iterations")
    ap.add_argument("--tol", type=float, default=1e-6, help="CG's relative residual")
    ap.add_argument("--learn", type=int, default=0, help="Adam steps on the SGPR bound before the fit")
    ap.add_argument("--rows", type=int, default=None, help="use only the first ROWS training rows")
    ap.add_argument("--check", action="store_true", help="rank 0 also fits one process on all rows and compares")
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    gpfalkon.init_distributed(timeout_s=args.timeout)  # the rendezvous comes from torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = DistributedBackend()

    xtr_all, ytr_all, xte, yte = load(0, dtype, args.rows)
    start, stop = shard_range(xtr_all.shape[0])
    x, y = xtr_all[start:stop], ytr_all[start:stop]  # this rank's rows (a real job reads only these)
    # global standardisation: sums over the shards (one all_reduce)
    n = torch.tensor(float(x.shape[0]), dtype=torch.float64)
    s1, s2, n, ys1, ys2 = backend.reduce(x.sum(0, dtype=torch.float64), x.double().square().sum(0), n,
                                         y.sum(dtype=torch.float64), y.double().square().sum())
    mu, sd = s1 / n, (s2 / n - (s1 / n) ** 2).clamp_min(1e-24).sqrt()
    ym, ys = ys1 / n, (ys2 / n - (ys1 / n) ** 2).sqrt()
    z = lambda a: ((a - mu) / sd).to(dtype)
    x, xte_z, y_z = z(x), z(xte), ((y - ym) / ys).to(dtype)

    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5)).to(dtype)
    options = FalkonOptions(backend=backend, max_iter=args.iterations, tol=args.tol)
    model = FalkonGP(x, y_z, kernel=kernel, num_centers=args.centers, penalty=args.penalty, seed=0, options=options)
    with torch.no_grad():  # identical on every rank: the centers are
        kernel.base_kernel.lengthscale = gpfalkon.median_lengthscale(model.centers) / 2
        kernel.outputscale = 1.0
    if args.learn:
        t0 = time.perf_counter()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        objective = SGPRBound(model)
        for _ in range(args.learn):
            opt.zero_grad()
            objective().backward()  # call the module: gradients summed over ranks
            opt.step()
        if rank == 0:
            print(f"learned {args.learn} Adam steps on the SGPR bound in {time.perf_counter() - t0:.2f} s: "
                  f"noise {float(model.noise.detach()):.4g}, "
                  f"lengthscale {float(kernel.base_kernel.lengthscale.detach()):.4g}")

    t0 = time.perf_counter()
    model.fit()
    t_fit = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        pred = model.likelihood(model(xte_z))  # the variance factors: one more collective pass
        mean = pred.mean.double() * ys + ym
    rmse = float(((mean - yte.double()) ** 2).mean().sqrt())
    if rank == 0:
        print(f"{world} ranks, rows per rank {backend.shard_sizes(x)}; M={args.centers}, "
              f"{model.fit_info.iterations} CG iterations, fit {t_fit:.2f} s; test RMSE {rmse:.4f}")
    else:
        backend.shard_sizes(x)  # every rank takes part in the collective rank 0 prints from
    if args.check and rank == 0:
        xs = z(xtr_all)
        ys_all = ((ytr_all - ym) / ys).to(dtype)
        ref = FalkonGP(xs, ys_all, kernel=model.kernel, centers=model.centers.detach().clone(),
                       penalty=float(model.penalty.detach()), max_iter=args.iterations, tol=args.tol)
        ref.fit()
        diff = float((ref.alpha - model.alpha).abs().max())
        scale = float(ref.alpha.abs().max())
        print(f"check: max |alpha - single-process alpha| = {diff:.3e} (max |alpha| {scale:.3e}); "
              f"single-process fit {ref.fit_info.iterations} CG iterations")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
