"""A penalty path in one CG (``FalkonGP.fit_penalty_path``) against one fit per penalty.

For each ``M`` and data dtype: ``n`` rows of a synthetic problem (d = 20, ``sin`` of a sum of 3 coordinates plus
noise, RBF kernel, lengthscale 4), the first ``M`` rows as centers, CG forced (``solve_method="cg"``), exactly
``--iterations`` iterations (``tol=0``). For ``p`` penalties (``--penalties``; log-spaced from ``1e-7`` to
``1e-3``): the wall time of one ``fit()`` (the first penalty), of ``p`` fits (one model each, one
``FactorCache`` shared, as ``auto_fit``'s noise searches run), and of one ``fit_penalty_path`` over the ``p``;
reported as ratios to the one fit measured in the same run (median of ``--repeats``, alternating). 'max |da|':
the largest difference between a path column and the separate fit at that penalty, relative to that fit's largest
coefficient (both after the same number of iterations: they differ by rounding only where the two runs' products
differ, e.g. float32 blocks summed in another order).

    .venv/bin/python benchmarks/penalty_path.py --out benchmarks/results/penalty-path.md
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FactorCache, FalkonGP, FalkonOptions

from _common import environment_lines, log, markdown_table, write_result


def _problem(n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, :3].sum(1)) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def _kernel(dtype: torch.dtype) -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).to(dtype)
    k.base_kernel.lengthscale = 4.0
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=43_000)
    ap.add_argument("--d", type=int, default=20)
    ap.add_argument("--centers", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    ap.add_argument("--penalties", type=int, nargs="+", default=[2, 4], help="numbers of penalties p")
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/penalty-path.md"))
    args = ap.parse_args()
    env = environment_lines()
    rows = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        x, y = _problem(args.n, args.d, dtype)
        kernel = _kernel(dtype)
        for m in args.centers:
            c = x[:m].clone()
            opts = FalkonOptions(solve_method="cg")

            def one(lam: float, cache: FactorCache | None = None, x: torch.Tensor = x, y: torch.Tensor = y,
                    kernel: gpytorch.kernels.Kernel = kernel, c: torch.Tensor = c,
                    opts: FalkonOptions = opts) -> FalkonGP:
                o = opts if cache is None else opts.replace(preconditioner=cache)
                return FalkonGP(x, y, kernel=kernel, centers=c, penalty=lam, tol=0.0, max_iter=args.iterations,
                                options=o).fit()

            for p in args.penalties:
                lams = torch.logspace(-7, -3, p, dtype=torch.float64).tolist()
                t_one, t_many, t_path = [], [], []
                path = None
                singles: list[FalkonGP] = []
                for _ in range(args.repeats):
                    gc.collect()
                    t = time.perf_counter()
                    one(lams[0])
                    t_one.append(time.perf_counter() - t)
                    gc.collect()
                    t = time.perf_counter()
                    cache = FactorCache()
                    singles = [one(lam, cache) for lam in lams]
                    t_many.append(time.perf_counter() - t)
                    del cache
                    gc.collect()
                    t = time.perf_counter()
                    model = FalkonGP(x, y, kernel=kernel, centers=c, penalty=lams[0], tol=0.0,
                                     max_iter=args.iterations, options=opts)
                    path = model.fit_penalty_path(lams)
                    t_path.append(time.perf_counter() - t)
                assert path is not None
                diff = max(float((path.alphas[j] - s.alpha).abs().max() / s.alpha.abs().max())
                           for j, s in enumerate(singles))
                one_s, many_s, path_s = (statistics.median(v) for v in (t_one, t_many, t_path))
                log(f"{dname} M={m} p={p}: one {one_s:.2f} s, {p} fits {many_s:.2f} s, path {path_s:.2f} s")
                rows.append([dname, f"{m:,}", p, f"{one_s:.2f}", f"{many_s:.2f}", f"{path_s:.2f}",
                             f"{path_s / one_s:.2f}", f"{many_s / path_s:.2f}", f"{diff:.1e}",
                             path.info.iterations])
                del path, singles
    body = markdown_table(["dtype", "M", "p", "one fit s", "p fits s", "path s", "path / one fit",
                           "p fits / path", "max |da|", "path iterations"], rows)
    body += (f"\n\nn = {args.n:,}, d = {args.d}, {args.iterations} CG iterations (tol = 0), penalties log-spaced "
             "from 1e-7 to 1e-3; medians of the repeats (each repeat runs the three one after the other).\n")
    out = write_result(args.out, "A penalty path in one CG against one fit per penalty", env, body)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
