"""A closed Bayesian-optimisation loop with FalkonModel, next to SingleTaskGP.

    .venv/bin/python examples/botorch_loop.py                         # Hartmann-6, 20 init + 15 x q=2
    .venv/bin/python examples/botorch_loop.py --plot regret.png       # also the regret curves (matplotlib)

Both surrogates are fitted by BoTorch's ``fit_gpytorch_mll`` at every iteration - SingleTaskGP with
its exact marginal likelihood, FalkonModel with :class:`gpfalkon.NystromMarginalLogLikelihood`
(the SGPR bound; the model is refitted by FALKON when the MLL returns to eval mode) - and the
next ``q`` points come from ``qLogNoisyExpectedImprovement`` optimised by ``optimize_acqf``. Both
loops start from the same Sobol points. Printed per iteration: the best value found and the
seconds spent fitting the surrogate.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from botorch.acquisition.logei import qLogNoisyExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.optim import optimize_acqf
from botorch.test_functions import Hartmann
from botorch.utils.sampling import draw_sobol_samples
from gpytorch.mlls import ExactMarginalLogLikelihood

from gpfalkon import NystromMarginalLogLikelihood
from gpfalkon.botorch import FalkonModel


def fit_single_task_gp(X: torch.Tensor, Y: torch.Tensor, num_centers: int):
    model = SingleTaskGP(X, Y)
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
    return model


def fit_falkon(X: torch.Tensor, Y: torch.Tensor, num_centers: int):
    # the noise model is SingleTaskGP's (LogNormal prior, bounded below by 1e-4 on standardised Y)
    model = FalkonModel(X, Y, num_centers=min(num_centers, X.shape[0]), fit=False, tol=1e-8, max_iter=500)
    fit_gpytorch_mll(NystromMarginalLogLikelihood(model.likelihood, model, objective="sgpr"))
    return model  # fitted by FALKON and in eval mode


def run(fit: Callable, problem: Hartmann, X0: torch.Tensor, iterations: int, q: int, num_centers: int,
        restarts: int, raw: int, seed: int) -> dict[str, list[float]]:
    bounds = problem.bounds.to(X0)
    X, Y = X0.clone(), problem(X0).unsqueeze(-1)
    best, fit_s = [float(Y.max())], []
    for it in range(iterations):
        torch.manual_seed(seed + it)
        t = time.perf_counter()
        model = fit(X, Y, num_centers)
        fit_s.append(time.perf_counter() - t)
        acqf = qLogNoisyExpectedImprovement(model, X_baseline=X, prune_baseline=True)
        cand, _ = optimize_acqf(acqf, bounds=bounds, q=q, num_restarts=restarts, raw_samples=raw)
        X = torch.cat([X, cand.detach()])
        Y = torch.cat([Y, problem(cand.detach()).unsqueeze(-1)])
        best.append(float(Y.max()))
    return {"best": best, "fit_s": fit_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--init", type=int, default=20, help="initial Sobol points")
    ap.add_argument("--q", type=int, default=2)
    ap.add_argument("--centers", type=int, default=64, help="FalkonModel's M (at most the number of points)")
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--raw-samples", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="save the best-value curves here (needs matplotlib)")
    args = ap.parse_args()

    problem = Hartmann(dim=6, negate=True).to(torch.float64)
    X0 = draw_sobol_samples(problem.bounds.to(torch.float64), n=args.init, q=1, seed=args.seed).squeeze(-2)
    results = {}
    for name, fit in (("SingleTaskGP", fit_single_task_gp), ("FalkonModel", fit_falkon)):
        results[name] = run(fit, problem, X0, args.iterations, args.q, args.centers, args.restarts,
                            args.raw_samples, args.seed)
    opt = float(problem.optimal_value)
    print(f"Hartmann-6 (maximum {opt:.4f}), {args.init} initial points, {args.iterations} iterations of q={args.q}")
    print(f"{'iteration':>9} | {'STGP best':>9} {'fit s':>6} | {'Falkon best':>11} {'fit s':>6}")
    a, b = results["SingleTaskGP"], results["FalkonModel"]
    for i in range(args.iterations):
        print(f"{i + 1:>9} | {a['best'][i + 1]:>9.4f} {a['fit_s'][i]:>6.2f} | "
              f"{b['best'][i + 1]:>11.4f} {b['fit_s'][i]:>6.2f}")
    for name, r in results.items():
        print(f"{name}: final regret {opt - r['best'][-1]:.4f}, mean fit {sum(r['fit_s']) / len(r['fit_s']):.2f} s")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name, r in results.items():
            ax.semilogy(range(len(r["best"])), [max(opt - v, 1e-6) for v in r["best"]], label=name)
        ax.set_xlabel("iteration")
        ax.set_ylabel("simple regret")
        ax.set_title("Hartmann-6, qLogNEI")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
