"""Bayesian optimisation with FalkonModel vs SingleTaskGP vs a GPyTorch SGPR model (issue 14).

    python benchmarks/bo.py                                  # both parts, results/bo.md + bo.png
    python benchmarks/bo.py --quick                          # a smoke run (not committed)
    python benchmarks/bo.py --parts scaling                  # one part

Parts (run one after the other; nothing else runs at the same time):

1. **loop**: closed BO loops on Hartmann-6 and Ackley-20 (BoTorch test functions, maximised as
   ``negate=True``, searched in the unit cube), ``--seeds`` seeds, ``--init`` Sobol points then
   batches of ``q`` from ``qLogNoisyExpectedImprovement`` up to ``--evals`` evaluations. At every
   iteration each surrogate is built from scratch and fitted by BoTorch's ``fit_gpytorch_mll``:
   SingleTaskGP (its exact marginal likelihood), FalkonModel (``NystromMarginalLogLikelihood``,
   the SGPR bound; ``M = min(n, --centers)`` uniform centers) and a GPyTorch SGPR model
   (``InducingPointKernel``, ``M = min(n, --centers)`` inducing points initialised at training
   rows, the exact MLL of the SGPR model). All three have SingleTaskGP's kernel
   (dimension-scaled LogNormal lengthscale prior), noise prior and Standardize. The three loops of
   one seed start from the same Sobol points. Recorded per iteration: best value, seconds to fit,
   seconds to optimise the acquisition function.
2. **scaling**: one BO iteration (fit + qLogNEI with ``q = 8``) at n = 500 .. 8000 random points
   of Hartmann-6, and ``qKnowledgeGradient`` (BoTorch's defaults: 64 fantasies; 10 restarts, 512
   raw samples) at n = 2000 for FalkonModel: the per-iteration cost as the data grow.
   SingleTaskGP is run up to n = 2000 (its fit is ``O(n^3)`` per MLL evaluation), the SGPR model up to
   n = 1000 (its ``fit_gpytorch_mll`` takes 45 s at n = 600 here: ``M d`` inducing-point coordinates).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from botorch.acquisition import qKnowledgeGradient
from botorch.acquisition.logei import qLogNoisyExpectedImprovement
from botorch.fit import fit_gpytorch_mll
from botorch.models import SingleTaskGP
from botorch.models.gpytorch import GPyTorchModel
from botorch.models.transforms.outcome import Standardize
from botorch.models.utils.gpytorch_modules import (
    get_covar_module_with_dim_scaled_prior,
    get_gaussian_likelihood_with_lognormal_prior,
)
from botorch.optim import optimize_acqf
from botorch.test_functions import Ackley, Hartmann
from botorch.utils.sampling import draw_sobol_samples
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import InducingPointKernel
from gpytorch.means import ConstantMean
from gpytorch.mlls import ExactMarginalLogLikelihood
from gpytorch.models import ExactGP

from gpfalkon import NystromMarginalLogLikelihood
from gpfalkon.botorch import FalkonModel

from _common import environment_lines, fmt, log, markdown_table, write_result

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DT = torch.float64


# ----------------------------------------------------------------------------- surrogates
class SGPRModel(ExactGP, GPyTorchModel):
    """GPyTorch's SGPR (Titsias) as a BoTorch model: ``InducingPointKernel`` over SingleTaskGP's
    kernel, noise prior and Standardize; ``M`` inducing points initialised at training rows."""

    _num_outputs = 1

    def __init__(self, X: torch.Tensor, Y: torch.Tensor, num_inducing: int, seed: int) -> None:
        tf = Standardize(m=1)
        Yt, _ = tf(Y)
        tf.eval()
        likelihood = get_gaussian_likelihood_with_lognormal_prior().to(X)
        super().__init__(X, Yt.squeeze(-1), likelihood)
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(X.shape[0], generator=g)[:num_inducing]
        self.mean_module = ConstantMean().to(X)
        base = get_covar_module_with_dim_scaled_prior(ard_num_dims=X.shape[-1]).to(X)
        self.covar_module = InducingPointKernel(base, inducing_points=X[idx].clone(), likelihood=likelihood)
        self.outcome_transform = tf

    def forward(self, x: torch.Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


def fit_stgp(X: torch.Tensor, Y: torch.Tensor, centers: int, seed: int) -> Any:
    model = SingleTaskGP(X, Y)
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
    return model


def fit_falkon(X: torch.Tensor, Y: torch.Tensor, centers: int, seed: int) -> Any:
    model = FalkonModel(X, Y, num_centers=min(centers, X.shape[0]), seed=seed, fit=False, tol=1e-8, max_iter=500)
    fit_gpytorch_mll(NystromMarginalLogLikelihood(model.likelihood, model))  # refitted by FALKON at the end
    return model


def fit_sgpr(X: torch.Tensor, Y: torch.Tensor, centers: int, seed: int) -> Any:
    model = SGPRModel(X, Y, min(centers, X.shape[0]), seed)
    fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model))
    model.eval()
    return model


MODELS: dict[str, Callable[..., Any]] = {"FalkonModel": fit_falkon, "SingleTaskGP": fit_stgp, "SGPR": fit_sgpr}


# ----------------------------------------------------------------------------- problems
def problem(name: str):
    if name == "hartmann6":
        return Hartmann(dim=6, negate=True).to(DT)
    if name == "ackley20":
        return Ackley(dim=20, negate=True).to(DT)
    raise ValueError(f"unknown problem {name!r}")


def evaluate(f: Any, x_unit: torch.Tensor) -> torch.Tensor:
    lb, ub = f.bounds[0].to(x_unit), f.bounds[1].to(x_unit)
    return f(lb + (ub - lb) * x_unit).unsqueeze(-1)


# ----------------------------------------------------------------------------- part 1
def bo_loop(pname: str, model: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    f = problem(pname)
    d = f.dim
    unit = torch.stack([torch.zeros(d, dtype=DT), torch.ones(d, dtype=DT)])
    X = draw_sobol_samples(unit, n=args.init, q=1, seed=seed).squeeze(-2)
    Y = evaluate(f, X)
    rec: dict[str, Any] = {"problem": pname, "model": model, "seed": seed, "n": [X.shape[0]],
                           "best": [float(Y.max())], "fit_s": [], "acq_s": []}
    it = 0
    while X.shape[0] < args.evals:
        q = min(args.q, args.evals - X.shape[0])
        torch.manual_seed(1000 * seed + it)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = MODELS[model](X, Y, args.centers, seed)
            t1 = time.perf_counter()
            acqf = qLogNoisyExpectedImprovement(m, X_baseline=X, prune_baseline=True)
            cand, _ = optimize_acqf(acqf, bounds=unit, q=q, num_restarts=args.restarts, raw_samples=args.raw_samples)
        t2 = time.perf_counter()
        cand = cand.detach()
        X, Y = torch.cat([X, cand]), torch.cat([Y, evaluate(f, cand)])
        rec["n"].append(X.shape[0])
        rec["best"].append(float(Y.max()))
        rec["fit_s"].append(t1 - t0)
        rec["acq_s"].append(t2 - t1)
        it += 1
    rec["optimal_value"] = float(f.optimal_value)
    return rec


def run_loops(args: argparse.Namespace, jsonl: pathlib.Path) -> list[dict[str, Any]]:
    done = {}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            r = json.loads(line)
            if r.get("part") == "loop":
                done[(r["problem"], r["model"], r["seed"])] = r
    out = []
    for pname in args.problems:
        for seed in range(args.seeds):
            for model in MODELS:
                key = (pname, model, seed)
                if key in done and done[key]["n"][-1] == args.evals:
                    out.append(done[key])
                    continue
                t = time.perf_counter()
                rec = bo_loop(pname, model, seed, args)
                rec["part"] = "loop"
                rec["wall_s"] = time.perf_counter() - t
                log(f"loop {pname} {model} seed {seed}: best {rec['best'][-1]:.4f} in {rec['wall_s']:.0f} s")
                with jsonl.open("a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                out.append(rec)
    return out


# ----------------------------------------------------------------------------- part 2
def run_scaling(args: argparse.Namespace, jsonl: pathlib.Path) -> list[dict[str, Any]]:
    f = problem("hartmann6")
    unit = torch.stack([torch.zeros(6, dtype=DT), torch.ones(6, dtype=DT)])
    out = []
    for n in args.scaling_n:
        g = torch.Generator().manual_seed(n)
        X = torch.rand(n, 6, generator=g, dtype=DT)
        Y = evaluate(f, X)
        for model in MODELS:
            if (model == "SingleTaskGP" and n > args.stgp_max_n) or (model == "SGPR" and n > args.sgpr_max_n):
                continue
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                m = MODELS[model](X, Y, args.centers, 0)
                t1 = time.perf_counter()
                acqf = qLogNoisyExpectedImprovement(m, X_baseline=X, prune_baseline=True)
                optimize_acqf(acqf, bounds=unit, q=8, num_restarts=args.restarts, raw_samples=args.raw_samples)
                t2 = time.perf_counter()
                kg_s = None
                if model == "FalkonModel" and n in args.kg_n:
                    t3 = time.perf_counter()
                    optimize_acqf(qKnowledgeGradient(m), bounds=unit, q=1, num_restarts=10, raw_samples=512)
                    kg_s = time.perf_counter() - t3
            rec = {"part": "scaling", "n": n, "model": model, "fit_s": t1 - t0, "acq_s": t2 - t1, "kg_s": kg_s}
            log(f"scaling n={n} {model}: fit {rec['fit_s']:.2f} s, qLogNEI {rec['acq_s']:.2f} s"
                + ("" if kg_s is None else f", qKG {kg_s:.1f} s"))
            with jsonl.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            out.append(rec)
    return out


# ----------------------------------------------------------------------------- report
def _mean_se(v: list[float]) -> str:
    if not v:
        return "-"
    m = sum(v) / len(v)
    if len(v) < 2:
        return fmt(m)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return f"{fmt(m)} ± {fmt(sd / math.sqrt(len(v)))}"


def _regret_at(rec: dict[str, Any], evals: int) -> float:
    best = [b for n, b in zip(rec["n"], rec["best"], strict=False) if n <= evals] or rec["best"][:1]
    return rec["optimal_value"] - best[-1]


def report_loops(recs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = []
    for pname in args.problems:
        rows = []
        for model in MODELS:
            rs = [r for r in recs if r["problem"] == pname and r["model"] == model]
            if not rs:
                continue
            marks = sorted({args.evals // 4, args.evals // 2, args.evals})
            half = len(rs[0]["fit_s"]) // 2
            rows.append([
                model, len(rs),
                *[_mean_se([_regret_at(r, e) for r in rs]) for e in marks],
                _mean_se([sum(r["fit_s"][:half]) / max(half, 1) for r in rs]),
                _mean_se([sum(r["fit_s"][half:]) / max(len(r["fit_s"]) - half, 1) for r in rs]),
                _mean_se([sum(r["acq_s"]) / len(r["acq_s"]) for r in rs]),
                _mean_se([r["wall_s"] for r in rs]),
            ])
        marks = sorted({args.evals // 4, args.evals // 2, args.evals})
        lines.append(f"### {pname}\n")
        lines.append(markdown_table(
            ["model", "seeds", *[f"regret @ {e} evals" for e in marks], "fit s/iter (first half)",
             "fit s/iter (second half)", "acqf s/iter", "loop s"], rows, align="l" + "r" * (5 + len(marks))))
        lines.append("")
    return "\n".join(lines)


def report_scaling(recs: list[dict[str, Any]]) -> str:
    ns = sorted({r["n"] for r in recs})
    rows = []
    for n in ns:
        row: list[Any] = [n]
        for model in MODELS:
            r = [x for x in recs if x["n"] == n and x["model"] == model]
            row += [r[0]["fit_s"], r[0]["acq_s"]] if r else [None, None]
        kg = [x["kg_s"] for x in recs if x["n"] == n and x.get("kg_s") is not None]
        row.append(kg[0] if kg else None)
        rows.append(row)
    heads = ["n"]
    for model in MODELS:
        heads += [f"{model} fit s", f"{model} qLogNEI s"]
    heads.append("FalkonModel qKG s")
    return markdown_table(heads, rows)


def plot(
    loops: list[dict[str, Any]], scaling: list[dict[str, Any]], args: argparse.Namespace, path: pathlib.Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probs = [p for p in args.problems if any(r["problem"] == p for r in loops)]
    ncol = len(probs) + (1 if scaling else 0)
    fig, axes = plt.subplots(2, max(ncol, 1), figsize=(4.2 * max(ncol, 1), 6.4), squeeze=False)
    for j, pname in enumerate(probs):
        for model in MODELS:
            rs = [r for r in loops if r["problem"] == pname and r["model"] == model]
            if not rs:
                continue
            n = rs[0]["n"]
            reg = torch.tensor([[r["optimal_value"] - b for b in r["best"]] for r in rs])
            m, se = reg.mean(0), reg.std(0) / math.sqrt(len(rs)) if len(rs) > 1 else torch.zeros(len(n))
            axes[0, j].plot(n, m, label=model)
            axes[0, j].fill_between(n, (m - se).clamp_min(1e-6), m + se, alpha=0.2)
            t = torch.tensor([[a + b for a, b in zip(r["fit_s"], r["acq_s"], strict=False)] for r in rs]).mean(0)
            axes[1, j].plot(n[:-1], t, label=model)
        axes[0, j].set_yscale("log")
        axes[0, j].set_title(f"{pname}: simple regret ({len(rs)} seeds)")
        axes[0, j].set_xlabel("evaluations")
        axes[1, j].set_title(f"{pname}: s per iteration (fit + acqf)")
        axes[1, j].set_xlabel("n (training points)")
        axes[0, j].legend(fontsize=8)
    if scaling:
        ax = axes[0, ncol - 1]
        for model in MODELS:
            rs = sorted((r for r in scaling if r["model"] == model), key=lambda r: r["n"])
            if rs:
                ax.loglog([r["n"] for r in rs], [r["fit_s"] + r["acq_s"] for r in rs], "o-", label=model)
        ax.set_title("Hartmann-6: one iteration (fit + qLogNEI, q=8)")
        ax.set_xlabel("n")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=8)
        axes[1, ncol - 1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="loop,scaling")
    ap.add_argument("--problems", default="hartmann6,ackley20")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--init", type=int, default=24)
    ap.add_argument("--evals", type=int, default=200)
    ap.add_argument("--q", type=int, default=8)
    ap.add_argument("--centers", type=int, default=128, help="M of FalkonModel and SGPR (at most n)")
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--raw-samples", type=int, default=256)
    ap.add_argument("--scaling-n", default="500,1000,2000,4000,8000")
    ap.add_argument("--kg-n", default="2000")
    ap.add_argument("--stgp-max-n", type=int, default=2000)
    ap.add_argument("--sgpr-max-n", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "bo.md"))
    ap.add_argument("--quick", action="store_true", help="small sizes, results/bo-quick.md (not committed)")
    ap.add_argument("--report-only", action="store_true", help="write the report from the .jsonl, run nothing")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.evals, args.init, args.q = 1, 40, 16, 8
        args.scaling_n, args.kg_n, args.out = "300,600", "600", str(RESULTS / "bo-quick.md")
    args.problems = [p for p in args.problems.split(",") if p]
    args.scaling_n = [int(v) for v in args.scaling_n.split(",") if v]
    args.kg_n = [int(v) for v in args.kg_n.split(",") if v]
    torch.set_num_threads(args.threads)
    env = environment_lines()
    out = pathlib.Path(args.out)
    jsonl = out.with_suffix(".jsonl")
    parts = args.parts.split(",")
    if args.report_only:  # the finished records of the .jsonl, whatever their number of seeds
        recs = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
        loops = [r for r in recs if r.get("part") == "loop" and r["problem"] in args.problems]
        scaling = [r for r in recs if r.get("part") == "scaling"]
    else:
        loops = run_loops(args, jsonl) if "loop" in parts else []
        scaling = run_scaling(args, jsonl) if "scaling" in parts else []
    body = [__doc__.split("\n\n", 1)[1].strip(), ""]
    seeds = {p: len({r["seed"] for r in loops if r["problem"] == p}) for p in args.problems}
    body.append(f"Settings: seeds {seeds}, {args.init} initial Sobol points, q = {args.q}, "
                f"{args.evals} evaluations, "
                f"M = min(n, {args.centers}), acquisition optimised with {args.restarts} restarts / "
                f"{args.raw_samples} raw samples, {args.threads} threads. Records: `{jsonl.name}`.\n")
    if loops:
        body += ["## 1. BO loops (regret: mean ± standard error over seeds)", "", report_loops(loops, args)]
    if scaling:
        body += ["## 2. One iteration as n grows (Hartmann-6, seconds)", "", report_scaling(scaling), ""]
    if loops or scaling:
        plot(loops, scaling, args, out.with_suffix(".png"))
        body.append(f"Plot: `{out.with_suffix('.png').name}`.")
    write_result(out, "Bayesian optimisation: FalkonModel vs SingleTaskGP vs SGPR", env, "\n".join(body))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
