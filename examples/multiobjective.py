"""Multi-objective BO with a ModelListGP of two FalkonModels and qLogNEHVI (BraninCurrin).

    .venv/bin/python examples/multiobjective.py                 # 12 initial points + 8 x q=2

Each objective gets its own FalkonModel, fitted by ``fit_gpytorch_mll`` with
:class:`gpfalkon.NystromMarginalLogLikelihood`; the list model's batched posteriors (``q x batch``
shapes) feed ``qLogNoisyExpectedHypervolumeImprovement``. Printed per iteration: the hypervolume
dominated by the points found so far.
"""
from __future__ import annotations

import argparse
import time

import torch
from botorch.acquisition.multi_objective.logei import qLogNoisyExpectedHypervolumeImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import ModelListGP
from botorch.models.transforms.input import Normalize
from botorch.models.utils.gpytorch_modules import MIN_INFERRED_NOISE_LEVEL
from botorch.optim import optimize_acqf
from botorch.test_functions.multi_objective import BraninCurrin
from botorch.utils.multi_objective.box_decompositions.dominated import DominatedPartitioning
from botorch.utils.sampling import draw_sobol_samples
from gpytorch.constraints import GreaterThan
from gpytorch.likelihoods import GaussianLikelihood

from gpfalkon import NystromMarginalLogLikelihood
from gpfalkon.botorch import FalkonModel


def fit_models(X: torch.Tensor, Y: torch.Tensor, bounds: torch.Tensor, centers: int) -> ModelListGP:
    models = []
    for j in range(Y.shape[-1]):
        likelihood = GaussianLikelihood(noise_constraint=GreaterThan(MIN_INFERRED_NOISE_LEVEL)).to(X)
        m = FalkonModel(X, Y[:, j : j + 1], num_centers=min(centers, X.shape[0]), likelihood=likelihood,
                        input_transform=Normalize(d=X.shape[-1], bounds=bounds), fit=False, tol=1e-8, max_iter=500)
        fit_gpytorch_mll(NystromMarginalLogLikelihood(m.likelihood, m))
        models.append(m)
    return ModelListGP(*models)


def hypervolume(Y: torch.Tensor, ref: torch.Tensor) -> float:
    return float(DominatedPartitioning(ref_point=ref, Y=Y).compute_hypervolume())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--init", type=int, default=12)
    ap.add_argument("--q", type=int, default=2)
    ap.add_argument("--centers", type=int, default=64)
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--raw-samples", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    problem = BraninCurrin(negate=True).to(torch.float64)
    bounds = problem.bounds.to(torch.float64)
    ref = problem.ref_point.to(torch.float64)
    X = draw_sobol_samples(bounds, n=args.init, q=1, seed=args.seed).squeeze(-2)
    Y = problem(X)
    print(f"BraninCurrin, {args.init} initial points: hypervolume {hypervolume(Y, ref):.3f} "
          f"(maximum {problem.max_hv:.3f})")
    for it in range(args.iterations):
        torch.manual_seed(args.seed + it)
        t = time.perf_counter()
        model = fit_models(X, Y, bounds, args.centers)
        t_fit = time.perf_counter() - t
        acqf = qLogNoisyExpectedHypervolumeImprovement(model=model, ref_point=ref.tolist(), X_baseline=X,
                                                       prune_baseline=True)
        cand, _ = optimize_acqf(acqf, bounds=bounds, q=args.q, num_restarts=args.restarts,
                                raw_samples=args.raw_samples)
        X = torch.cat([X, cand.detach()])
        Y = torch.cat([Y, problem(cand.detach())])
        print(f"iteration {it + 1}: hypervolume {hypervolume(Y, ref):.3f}, fit {t_fit:.2f} s, "
              f"total {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
