"""Fastfood vs GPyTorch RFFKernel (Random Kitchen Sinks): kernel accuracy vs D, and feature speed.

    .venv/bin/python benchmarks/fastfood.py [--seeds 8] [--n-speed 20000] [--features 4096]

Accuracy: on 500 training rows of protein (d=9) and a9a (d=123, padded to 128), both
standardised as in ``benchmarks/compare.py``, lengthscale = the median heuristic, float64:
the mean over seeds of ||K_approx - K||_F / n for D = 64 ... 4096 features, for
``FastfoodKernel`` (RBF and Matern-3/2) and GPyTorch's ``RFFKernel`` (RBF only: GPyTorch
has no Matern random features). Both estimators are unbiased with error ~ 1/sqrt(D).

Speed: float32, n points x D features, the wall time (median of 3 after a warm-up) of
* ``x @ W^T`` for RFF (its whole projection: one matmul),
* Fastfood's projection through each of its two paths: the dense D x d frequency matrix
  built by the structured transform then one matmul (what ``_project`` uses for
  d' <= 2048 and n >= d'), and the structured S H G Pi H B product on the data;
* the full features [cos, sin] of both kernels;
* ``fwht`` (blocked Kronecker matmuls) against the log2(d) elementwise butterfly passes
  it replaced, on the n x (D/d') x d' tensor the structured path transforms.
d = 9 and 123 are protein's and a9a's dimensions; larger d use random inputs (no dataset
in ../shared/data has d > 128), where Fastfood's O(D log d) is meant to pay off.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import gpytorch
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon.kernels.fastfood import _DENSE_MAX_DIMS, FastfoodKernel, fwht

from _common import REPO, environment_lines, log, markdown_table, median_time, write_result
from compare import load_dataset, median_ls

FEATURES = (64, 256, 1024, 4096)
SPEED_DIMS = (9, 123, 512, 1024, 2048, 4096)


def butterfly(x: torch.Tensor) -> torch.Tensor:
    """The textbook FWHT: log2(d) passes of elementwise butterflies (the implementation fwht replaced)."""
    d, h, lead = x.shape[-1], 1, x.shape[:-1]
    y = x
    while h < d:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(*lead, d)


def accuracy(name: str, seeds: int) -> list[list]:
    data = load_dataset(name)
    x = data["xtr"][torch.randperm(len(data["xtr"]), generator=torch.Generator().manual_seed(0))[:500]].double()
    d = x.shape[-1]
    ls = median_ls(x)
    rows = []
    for label, nu in (("RBF", None), ("Matern-3/2", 1.5)):
        exact_k = gpytorch.kernels.RBFKernel() if nu is None else gpytorch.kernels.MaternKernel(nu=nu)
        exact_k = exact_k.double()
        exact_k.lengthscale = ls
        with torch.no_grad():
            exact = exact_k(x).to_dense()
        for D in FEATURES:
            errs: dict[str, list[float]] = {"ff": [], "rff": []}
            for s in range(seeds):
                gen = torch.Generator().manual_seed(1000 * D + s)
                ff = FastfoodKernel(D, num_dims=d, nu=nu, generator=gen).double()
                ff.lengthscale = ls
                with torch.no_grad():
                    errs["ff"].append(float((ff(x).to_dense() - exact).norm() / len(x)))
                if nu is None:
                    with torch.random.fork_rng():
                        torch.manual_seed(1000 * D + s)
                        rff = gpytorch.kernels.RFFKernel(D, num_dims=d).double()
                    rff.lengthscale = ls
                    with torch.no_grad():
                        errs["rff"].append(float((rff(x).to_dense() - exact).norm() / len(x)))
            ff_e = float(np.mean(errs["ff"]))
            rff_e = float(np.mean(errs["rff"])) if errs["rff"] else None
            rows.append([f"{name} (d={d})", label, D, ff_e, rff_e, ff_e / rff_e if rff_e else None])
            log(f"  {name} {label} D={D}: fastfood {ff_e:.4g} rff {rff_e}")
    return rows


def speed(n: int, D: int) -> list[list]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for d in SPEED_DIMS:
        x = torch.randn(n, d, generator=g)
        ff = FastfoodKernel(D, num_dims=d, generator=torch.Generator().manual_seed(1))
        with torch.random.fork_rng():
            torch.manual_seed(1)
            rff = gpytorch.kernels.RFFKernel(D, num_dims=d)
        dp = ff.padded_dims
        w = rff.randn_weights.detach()
        with torch.no_grad():
            eye = torch.eye(d, dp)
            t_rff, _ = median_time(lambda x=x, w=w: x @ w)
            t_dense, _ = median_time(lambda x=x, ff=ff, eye=eye: x @ ff._project_structured(eye))
            t_struct, _ = median_time(lambda ff=ff, x=x: ff._project_structured(x))
            t_ff_feat, _ = median_time(lambda ff=ff, x=x: ff._featurize(x))
            t_rff_feat, _ = median_time(lambda rff=rff, x=x: rff._featurize(x))
            y = torch.randn(n, ff.num_blocks, dp, generator=g)
            t_fwht, _ = median_time(lambda y=y: fwht(y))
            t_bfly, _ = median_time(lambda y=y: butterfly(y))
        path = "dense" if dp <= _DENSE_MAX_DIMS and n >= dp else "structured"
        used = t_dense if path == "dense" else t_struct
        rows.append([d, dp, t_rff, t_dense, t_struct, path, used / t_rff,
                     t_rff_feat, t_ff_feat, t_ff_feat / t_rff_feat, t_bfly, t_fwht, t_bfly / t_fwht])
        log(f"  d={d}: rff {t_rff:.3f} dense {t_dense:.3f} structured {t_struct:.3f} | features rff {t_rff_feat:.3f}"
            f" fastfood {t_ff_feat:.3f} | butterfly {t_bfly:.3f} fwht {t_fwht:.3f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--n-speed", type=int, default=20000)
    ap.add_argument("--features", type=int, default=4096, help="D for the speed part")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "fastfood.md"))
    args = ap.parse_args()
    env = environment_lines()
    torch.set_grad_enabled(False)

    log("accuracy")
    acc = accuracy("protein", args.seeds) + accuracy("a9a", args.seeds)
    log("speed")
    spd = speed(args.n_speed, args.features)
    body = [
        f"Accuracy: ||K_approx - K||_F / n on 500 rows, median-heuristic lengthscale, float64, mean of {args.seeds} "
        "seeds (RFF: GPyTorch `RFFKernel`, RBF only).",
        "",
        markdown_table(["data", "kernel", "D", "Fastfood error", "RFF error", "Fastfood / RFF"], acc, "llrrrr"),
        "",
    ]
    for (data, kern) in sorted({(r[0], r[1]) for r in acc}):
        e = [r[3] for r in acc if r[0] == data and r[1] == kern]
        slope = float(np.polyfit(np.log(FEATURES), np.log(e), 1)[0])
        body.append(f"- {data} {kern}: Fastfood error(64) / error(4096) = {e[0] / e[-1]:.1f} (1/sqrt(D) predicts 8), "
                    f"log-log slope {slope:.2f} (predicts -0.5)")
    body += [
        "",
        f"Speed: float32, n = {args.n_speed:,} points, D = {args.features:,} features, seconds (median of 3). "
        "'path' is the projection `FastfoodKernel._project` takes; 'used / RFF' its time over RFF's matmul.",
        "",
        markdown_table(
            ["d", "d'", "RFF x W^T", "FF dense V", "FF structured", "path", "used / RFF", "RFF features",
             "FF features", "FF / RFF features", "butterfly FWHT", "fwht", "fwht speed-up"],
            spd, "rrrrrlrrrrrrr"),
    ]
    out = write_result(pathlib.Path(args.out), "Fastfood vs RFF: accuracy and speed", env, "\n".join(body))
    log(f"written {out}")


if __name__ == "__main__":
    main()
