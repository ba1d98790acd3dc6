"""The Gram route's backward: ``_GramProjection`` (the library's) against the pair it replaced.

Before: ``G = K^T K`` by a custom function (``dK = K (dG + dG^T)``) and ``g = K^T y`` by autograd's ``mm``,
whose backward forms ``y dg^T`` by a ``(rows, 1) x (1, M)`` GEMM. After: both in one function, the rank-one
term added by a broadcast product. The same values and gradients bit for bit (``tests/test_objectives.py``).
For each shape and kernel a float32 ``FalkonGP`` (ARD lengthscales sqrt(d), targets sin(x_1) plus noise) and
each objective: value + ``backward``, the two versions alternating in one process; ms = median.

    .venv/bin/python benchmarks/gram_projection_ab.py --out benchmarks/results/gram-projection.md
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from functools import partial

import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.backend.passes as PS
from gpfalkon import FalkonGP
from gpfalkon.backend.engine import kernel_block
from gpfalkon.objectives import GCV, SGPRBound

from _common import REPO, environment_lines, log, markdown_table, write_result


class _SymmetricGram(torch.autograd.Function):
    """The previous version's ``G = K^T K`` (``dK = K (dG + dG^T)``)."""

    @staticmethod
    def forward(ctx, kb):
        ctx.save_for_backward(kb)
        return kb.mT @ kb

    @staticmethod
    def backward(ctx, grad):
        (kb,) = ctx.saved_tensors
        return kb @ (grad + grad.mT)


NEW = PS._gram_aggregates


def old_gram_aggregates(kernel, x, y, centers, L, rows):
    """``passes._gram_aggregates`` as it was, with ``_SymmetricGram`` and autograd's ``K^T y``."""

    def block(xb, yb, c_):
        kb = kernel_block(kernel, xb, c_).to(torch.float64)
        return _SymmetricGram.apply(kb), kb.mT @ yb.to(torch.float64), kernel(xb, diag=True).sum()

    m = centers.shape[0]
    acc = None
    ranges = list(PS.row_blocks(x.shape[0], rows))
    keep = PS._keep_graph(x, centers, ranges)
    for s, e, xb in PS.row_slices(x, ranges):
        policy = None if PS.selective_contexts is None else partial(PS.selective_contexts,
                                                                    PS._keep_center_products(m, e - s))
        out = PS._checkpointed(block, keep, xb, y[s:e], centers, context_fn=policy)
        acc = list(out) if acc is None else [a + o for a, o in zip(acc, out, strict=True)]
    gram, ky, tr_knn = acc
    L64 = L.to(torch.float64)
    half = torch.linalg.solve_triangular(L64, gram, upper=False)
    aat = torch.linalg.solve_triangular(L64, half.mT, upper=False)
    aat = (aat + aat.mT) / 2
    ay = torch.linalg.solve_triangular(L64, ky, upper=False)
    return PS.WhitenedAggregates(aat.to(L.dtype), ay.to(L.dtype), aat.diagonal().sum().to(L.dtype), tr_knn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2000x300x17", "4000x500x20", "16000x1000x8"])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "gram-projection.md")
    args = ap.parse_args()
    env = environment_lines()
    torch.manual_seed(0)
    rows = []
    ratios = []
    try:
        for shape in args.shapes:
            n, m, d = (int(v) for v in shape.split("x"))
            for kname in ("rbf", "matern52"):
                x = torch.randn(n, d)
                y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n)
                base = RBFKernel(ard_num_dims=d) if kname == "rbf" else MaternKernel(nu=2.5, ard_num_dims=d)
                k = ScaleKernel(base)
                k.base_kernel.lengthscale = d**0.5
                model = FalkonGP(x, y, kernel=k, centers=x[:m].clone(), penalty=1e-3 / n)
                params = [p for p in model.parameters() if p.requires_grad]
                for oname, cls in (("GCV", GCV), ("SGPRBound", SGPRBound)):
                    obj = cls(model)

                    def step(obj=obj, params=params):
                        for p in params:
                            p.grad = None
                        obj().backward()

                    t: dict[str, list[float]] = {"before": [], "after": []}
                    reps = args.repeats if n * m <= 4_000_000 else max(3, args.repeats // 3)
                    for _ in range(reps):
                        for name, fn in (("before", old_gram_aggregates), ("after", NEW)):
                            PS._gram_aggregates = fn
                            t0 = time.perf_counter()
                            step()
                            t[name].append(time.perf_counter() - t0)
                    mb, ma = statistics.median(t["before"]) * 1e3, statistics.median(t["after"]) * 1e3
                    ratios.append(mb / ma)
                    rows.append([shape, kname, oname, reps, mb, ma, mb / ma])
                    log(f"{shape} {kname} {oname}: before {mb:.1f} ms, after {ma:.1f} ms, {mb / ma:.3f}")
    finally:
        PS._gram_aggregates = NEW
    gm = statistics.geometric_mean(ratios)
    table = markdown_table(["n x M x d", "kernel", "objective", "repeats", "before ms", "after ms", "before / after"],
                           rows, align="lllrrrr")
    body = (f"Value + backward of one objective, float32 data (the Gram route), the two versions alternating; "
            f"ms = median.\n\n{table}\n\nGeometric mean before / after: **{gm:.3f}** over {len(ratios)} cases.\n")
    write_result(args.out, "Gram route backward: one function for K^T K and K^T y", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
