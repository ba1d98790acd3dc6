"""Cost of FalkonModel.posterior after the fit: O(M^2) per test point, independent of n.

For n in --n and M in --m: fit a FalkonModel (synthetic d=4 data, Matern 5/2),
time the first posterior call (which forms the O(n M^2) variance factors once),
then the steady-state cost of posterior(X).mean + .variance for a batch of
b x q points (median of repeats). Shows the per-point time growing like M^2 and not with n.

    .venv/bin/python benchmarks/botorch_posterior.py [--n 10000 100000] [--m 250 500 1000 2000]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon.botorch import FalkonModel

from _common import REPO, environment_lines, log, markdown_table, median_time, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--m", type=int, nargs="+", default=[250, 500, 1000, 2000])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--q", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "botorch_posterior.md")
    args = ap.parse_args()
    env = environment_lines()
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in args.n:
        X = torch.rand(n, 4, generator=g, dtype=torch.float64)
        Y = (torch.sin(5 * X[:, :1]) + X[:, 1:2] ** 2 + 0.05 * torch.randn(n, 1, generator=g, dtype=torch.float64))
        Xt = torch.rand(args.batch, args.q, 4, generator=g, dtype=torch.float64)
        for m in args.m:
            t0 = time.perf_counter()
            model = FalkonModel(X, Y, num_centers=m, penalty=1e-5, max_iter=20, tol=0)
            t_fit = time.perf_counter() - t0
            t0 = time.perf_counter()
            with torch.no_grad():
                p = model.posterior(Xt)
                _ = p.mean, p.variance  # evaluate the lazy posterior (forms the cached factors)
            t_first = time.perf_counter() - t0

            def call(model=model, Xt=Xt):
                with torch.no_grad():
                    p = model.posterior(Xt)
                    return p.mean, p.variance

            t_post, _ = median_time(call, repeats=args.repeats)
            per_point = t_post / (args.batch * args.q)
            rows.append([n, m, t_fit, t_first, t_post, per_point * 1e6, per_point * 1e9 / m**2])
            log(f"n={n:,} M={m:,}: fit {t_fit:.2f} s, first posterior {t_first:.2f} s, posterior {t_post * 1e3:.1f} ms "
                f"({per_point * 1e6:.1f} us/point)")
    table = markdown_table(
        ["n", "M", "fit s", "first posterior s (forms factors)", "posterior s", "us / point", "ns / point / M^2"],
        rows, align="rrrrrrr")
    body = (f"posterior(X) with X of shape {args.batch} x {args.q} x 4 (mean + variance of every joint q-batch), "
            f"median of {args.repeats}; FalkonModel fitted with 20 CG iterations.\n\n" + table + "\n")
    write_result(args.out, "FalkonModel.posterior cost after the fit", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
