"""Posterior mean at test points: the kernel engine's no-grad fast path against GPyTorch's kernel path.

``FalkonGP.posterior_mean`` (no gradient) computes ``K_*M alpha`` in float64 blocks. For RBF / Matern
kernels it goes through ``KernelEngine.k_matmul`` (one augmented matmul and an ``exp2`` pass per
block); with ``gpfalkon.backend.passes.stationary_spec`` patched to ``None`` it goes through
GPyTorch's kernel call (the path taken where a gradient is recorded). For each kernel: a model on
``n`` synthetic rows (d = 8) with M uniform centers, fitted once; then the mean at ``q`` test points
both ways, alternating, median of ``--repeats``. 'rel. diff' = max |fast - generic| / max |generic| of the
returned means (in the model's dtype, float32; both are computed in float64, and
``tests/test_engine.py`` checks them against the closed form to 1e-10).

    .venv/bin/python benchmarks/predict.py --out benchmarks/results/predict.md
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.backend.passes as passes
from gpfalkon import FalkonGP

from _common import environment_lines, log, markdown_table, write_result


def kernels(d: int) -> dict[str, gpytorch.kernels.Kernel]:
    rbf = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel(ard_num_dims=d))
    m52 = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d))
    m12 = gpytorch.kernels.MaternKernel(nu=0.5, ard_num_dims=d)
    for k in (rbf.base_kernel, m52.base_kernel, m12):
        k.lengthscale = torch.linspace(0.8, 2.0, d)
    return {"RBF (ARD, scaled)": rbf, "Matern 5/2 (ARD, scaled)": m52, "Matern 1/2 (ARD)": m12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--q", type=int, default=100_000)
    ap.add_argument("--m", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/predict.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    d = 8
    x = torch.randn(args.n, d, generator=g)
    y = torch.sin(x[:, :4].sum(-1)) + 0.1 * torch.randn(args.n, generator=g)
    xq = torch.randn(args.q, d, generator=g)
    real_spec = passes.stationary_spec
    rows = []
    for name, kernel in kernels(d).items():
        for m in args.m:
            model = FalkonGP(x, y, kernel=kernel, centers=x[:m].clone(), penalty=1e-4).fit()
            model.eval()
            times: dict[str, list[float]] = {"fast": [], "generic": []}
            outs = {}
            for _ in range(args.repeats):
                for way in ("fast", "generic"):
                    passes.stationary_spec = real_spec if way == "fast" else (lambda k: None)  # type: ignore
                    try:
                        t0 = time.perf_counter()
                        outs[way] = model.posterior_mean(xq)
                        times[way].append(time.perf_counter() - t0)
                    finally:
                        passes.stationary_spec = real_spec
            fast, generic = statistics.median(times["fast"]), statistics.median(times["generic"])
            diff = float((outs["fast"] - outs["generic"]).abs().max() / outs["generic"].abs().max())
            rows.append([name, m, args.q, generic, fast, generic / fast, diff])
            log(f"{name} M={m}: generic {generic:.3f} s, fast {fast:.3f} s ({generic / fast:.2f}x), diff {diff:.1e}")
    body = (
        f"n = {args.n:,} training rows (float32 model), q = {args.q:,} test points, d = {d}; the model's "
        f"predict_chunk_size (4,096 points per block); {args.repeats} repetitions, the two ways alternating, "
        "seconds = median.\n\n"
        + markdown_table(["kernel", "M", "q", "GPyTorch path s", "engine path s", "speed-up", "rel. diff"], rows)
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "Posterior mean: kernel engine vs GPyTorch kernel path", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
