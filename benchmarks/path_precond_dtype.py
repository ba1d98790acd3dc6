"""A grown final fit's penalty path with its preconditioner's factors stored in float64 (the default) and in
float32 (``FalkonOptions(precond_dtype=torch.float32)``): wall time, the factorisations' and triangular solves'
seconds, the true relative residual of each column and its test NRMSE after a fixed number of CG iterations.

One ``auto_fit(budget)`` run per dataset supplies the kernel and the grown fit's noises (``auto_report.growth``);
then FALKON on all training rows at that kernel, ``M`` uniform centers (default: auto_fit's), the noises as one
penalty path, ``tol=0`` and ``max_iter`` in ``--iterations``, no warm start. Usage (repository root):

    GPFALKON_DATA=/work/shared/data .venv/bin/python benchmarks/path_precond_dtype.py --datasets kin40k bike \\
        --split 4 --budget 10 --out benchmarks/results/precond-float32-path.md
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", nargs="+", default=["kin40k", "bike"])
    p.add_argument("--split", type=int, default=4)
    p.add_argument("--budget", type=float, default=10.0)
    p.add_argument("--iterations", nargs="+", type=int, default=[10, 20, 30, 45])
    p.add_argument("--out", default=str(HERE / "results" / "precond-float32-path.md"))
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    from gpfalkon import FalkonGP, FalkonOptions, auto_fit

    import compare as C
    from _common import environment_lines, write_result

    C.SPLIT["k"] = args.split
    env = environment_lines()
    lines = ["| dataset | M | iterations | factors | wall s | factorisations s | triangular solves s | "
             "true relative residual per noise | test NRMSE per noise |", "|:--|--:|--:|:--|--:|--:|--:|:--|:--|"]
    for name in args.datasets:
        data = C.load_dataset(name)
        x, y = data["xtr"], data["ytr"].double() * data["y_scale"] + data["y_mean"]
        model = auto_fit(x, y, budget=args.budget, seed=0)
        g = model.auto_report.growth
        y_sd = float(y.std())
        noises = [v * y_sd**2 for v in (g["noises"] if g else [float(model.penalty) * x.shape[0]])]
        x32, y32 = x.float(), y.float()
        m = int(model.centers.shape[0])
        idx = torch.randperm(x32.shape[0], generator=torch.Generator().manual_seed(1))[:m]
        for its in args.iterations:
            for dt in (torch.float64, torch.float32):
                fit = FalkonGP(x32, y32, kernel=copy.deepcopy(model.kernel), centers=x32[idx],
                               penalty=float(model.penalty), mean_constant=float(model.mean_constant),
                               max_iter=its, tol=0.0, options=FalkonOptions(precond_dtype=dt, solve_method="cg"))
                t = time.perf_counter()
                path = fit.fit_penalty_path([v / x32.shape[0] for v in noises])
                wall = time.perf_counter() - t
                means = fit.path_means(path, data["xte"])
                errs = [C.metrics(data, (mu - data["y_mean"]) / data["y_scale"])["error"] for mu in means]
                ex = path.info.extra
                res = " / ".join(f"{float(r):.3g}" for r in path.info.final_residual.reshape(-1))
                lines.append(f"| {name} | {m:,} | {its} | {str(dt).replace('torch.', '')} | {wall:.2f} | "
                             f"{ex.get('preconditioner_seconds', 0.0):.2f} | {ex.get('precond_apply_seconds', 0.0):.2f}"
                             f" | {res} | {' / '.join(f'{e:.4f}' for e in errs)} |")
                print(lines[-1], flush=True)
    body = (f"auto_fit(budget={args.budget:g}, seed=0) per dataset on split {args.split} gives the kernel, the grown "
            "fit's noises (standardised, times the targets' variance) and M; then one penalty path over all training "
            "rows, float32 data, float64 products, no warm start, exactly the iterations shown.\n\n" + "\n".join(lines))
    write_result(pathlib.Path(args.out), "A penalty path with float32 factors", env, body)


if __name__ == "__main__":
    main()
