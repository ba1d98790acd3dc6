"""CG of a final fit from zero and from a subsample fit's coefficients (``FalkonGP.fit(initial_alpha=...)``).

``auto_fit`` (at ``--budget`` seconds) picks the kernel, the centers and the noise ``sigma^2 = n lambda`` on a
dataset of ``benchmarks/compare.py``; with those, a fit on ``--sub-rows`` training rows (the start; 25 CG
iterations) and fits on ``n_f`` other rows (``n_f`` = the rows of auto_fit's final model) with a fixed number of
CG iterations (``tol = 0``) from zero and from the start: wall seconds, CG's final relative residual and the
test NRMSE of each. Each fit is timed alone (one process, one after another).

    GPFALKON_DATA=../shared/data .venv/bin/python benchmarks/final_start.py --dataset flights --budget 40 \\
        --out benchmarks/results/final-start-flights.md
"""
from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, log, markdown_table, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="flights")
    ap.add_argument("--budget", type=float, default=40.0)
    ap.add_argument("--sub-rows", type=int, default=200_000)
    ap.add_argument("--iterations", type=int, nargs="+", default=[5, 10, 15, 25])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/final-start.md"))
    args = ap.parse_args()
    from gpfalkon import CGNotConvergedWarning, FalkonGP, auto_fit

    from compare import load_dataset, metrics

    warnings.simplefilter("ignore", CGNotConvergedWarning)
    data = load_dataset(args.dataset)
    x, y = data["xtr"], data["ytr"].double() * data["y_scale"] + data["y_mean"]
    t0 = time.perf_counter()
    model = auto_fit(x, y, budget=args.budget, seed=0)
    auto_s = time.perf_counter() - t0
    n_f = int(model.train_inputs[0].shape[0])
    noise = float(model.penalty.detach()) * n_f
    mean_c = float(model.mean_constant.reshape(-1)[0])
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    sub = perm[n_f: n_f + args.sub_rows] if n_f + args.sub_rows <= x.shape[0] else perm[: args.sub_rows]
    rows = perm[:n_f]
    y32 = y.to(x.dtype)

    def fit(idx: torch.Tensor, iterations: int, start: torch.Tensor | None) -> tuple[FalkonGP, float]:
        m = FalkonGP(x[idx], y32[idx], kernel=copy.deepcopy(model.kernel), centers=model.centers.detach().clone(),
                     penalty=noise / idx.shape[0], mean_constant=mean_c, max_iter=iterations, tol=0.0)
        t = time.perf_counter()
        m.fit(initial_alpha=start)
        return m, time.perf_counter() - t

    def nrmse(m: FalkonGP) -> float:
        m.eval()
        with torch.no_grad():
            raw = torch.cat([m.posterior_mean(c) for c in data["xte"].split(200_000)])
        return float(metrics(data, (raw - data["y_mean"]) / data["y_scale"])["error"])

    start_model, start_s = fit(sub, 25, None)
    start = start_model.alpha.detach().clone()
    start_err = nrmse(start_model)
    log(f"start: {sub.shape[0]:,} rows, {start_s:.2f} s, test NRMSE {start_err:.4f}")
    table = []
    for iterations in args.iterations:
        for label, a0 in (("zero", None), ("subsample fit", start)):
            m, sec = fit(rows, iterations, a0)
            info = m.fit_info
            table.append([iterations, label, f"{sec:.2f}", f"{float(info.residuals[0].max()):.3g}",
                          f"{float(info.final_residual.max()):.3g}", f"{nrmse(m):.4f}"])
            log(" ".join(map(str, table[-1])))
            del m
    c = model.auto_report.chosen
    body = [f"{args.dataset}: auto_fit at {args.budget:g} s ({auto_s:.1f} s) chose M = {c['num_centers']:,} "
            f"({c['centers']}), noise {c['noise_raw']:.4g} (raw units), final rows n_f = {n_f:,}. The start: a fit "
            f"of those centers and hyperparameters on {sub.shape[0]:,} other training rows, 25 CG iterations, "
            f"{start_s:.2f} s, test NRMSE {start_err:.4f}. Then fits on n_f rows (random, seed 1) with a fixed "
            "number of CG iterations from zero and from the start (float32 kernel values; the first pass computes "
            "K_nM into its store and K_Mn y; a start costs one more pass).", "",
            markdown_table(["CG iterations", "start", "fit s", "initial residual", "final residual", "test NRMSE"],
                           table, align="rlrrrr")]
    path = write_result(args.out, "A final fit's CG from zero and from a subsample fit", environment_lines(),
                        "\n".join(body))
    log(f"written {path}")


if __name__ == "__main__":
    main()
