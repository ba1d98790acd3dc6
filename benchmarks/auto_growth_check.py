"""Test error of ``auto_fit``'s chosen level refitted with more centers, at its noise and around it.

``auto_fit``'s ``final_growth`` gives the final fit up to twice the chosen level's centers at the level's
noise and lengthscale multiplier, without a validation fit at the grown size. This check asks, apart from
the run-to-run spread of the learning stage (which decides most A/B differences at small budgets), whether
more centers at that noise help or hurt: one ``auto_fit`` run per ``dataset:budget`` and seed, then refits
of its final model's kernel on the same rows (training plus held-out) with ``f x M_level`` centers
(``--factors``; uniform prefixes of one random permutation of those rows, so the sizes are nested) at the
level's noise, and at ``--noise-factors`` times it for the sizes in ``--noise-at``. Each refit's test NRMSE
and wall time go to a ``.jsonl`` and a table. Test error is what it reports, for diagnosis only: nothing in
the library is chosen from it.

Usage (from the repository root):

    GPFALKON_DATA=/work/shared/data .venv/bin/python benchmarks/auto_growth_check.py \\
        --runs bike:12 kin40k:12 --seeds 0 1 --out benchmarks/results/auto-growth-check.md
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import time
import warnings

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpfalkon  # noqa: E402

from _common import environment_lines, markdown_table, write_result  # noqa: E402
from compare import load_dataset  # noqa: E402


def _nrmse(model: gpfalkon.FalkonGP, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model.posterior_mean(x).double()
    return float((pred - y).square().mean().sqrt() / y.std())


def run_one(spec: str, seed: int, factors: list[float], noise_factors: list[float], noise_at: list[float]) -> dict:
    name, budget = spec.rsplit(":", 1)
    data = load_dataset(name)
    xte, yte = data["xte"], data["yte"].double()
    t = time.perf_counter()
    model = gpfalkon.auto_fit(data["xtr"], data["ytr"].double(), budget=float(budget), seed=seed)
    wall = time.perf_counter() - t
    chosen = model.auto_report.chosen
    m_level = int(chosen["grown_from"] or chosen["num_centers"])
    x_fin, y_fin = model.train_inputs[0], model.train_targets
    perm = torch.randperm(x_fin.shape[0], generator=torch.Generator().manual_seed(1000 + seed))
    rec = dict(spec=spec, dataset=name, seed=seed, wall=wall, auto_nrmse=_nrmse(model, xte, yte),
               auto_M=int(chosen["num_centers"]), level_M=m_level, noise=chosen["noise"],
               multiplier=chosen["multiplier"], level_centers=chosen["centers"], refits=[])
    for f in factors:
        m = min(round(f * m_level), x_fin.shape[0])
        for nf in (noise_factors if f in noise_at else [1.0]):
            t = time.perf_counter()
            refit = gpfalkon.FalkonGP(x_fin, y_fin, kernel=copy.deepcopy(model.kernel), centers=x_fin[perm[:m]],
                                      penalty=float(model.penalty.detach()) * nf, mean_constant=model.mean_constant,
                                      max_iter=50, tol=1e-4)
            refit.fit()
            sec = time.perf_counter() - t
            rec["refits"].append(dict(factor=f, M=m, noise_factor=nf, seconds=sec, nrmse=_nrmse(refit, xte, yte)))
            del refit
    return rec


def main() -> None:
    warnings.filterwarnings("ignore", category=gpfalkon.CGNotConvergedWarning)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True, help="dataset:budget specs")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--factors", nargs="+", type=float, default=[1.0, 2.0, 3.0, 4.0])
    ap.add_argument("--noise-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    ap.add_argument("--noise-at", nargs="+", type=float, default=[2.0, 4.0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    jsonl = out.with_suffix(".jsonl")
    env = environment_lines()
    t0 = time.perf_counter()
    recs = []
    for seed in args.seeds:
        for spec in args.runs:
            rec = run_one(spec, seed, args.factors, args.noise_factors, args.noise_at)
            recs.append(rec)
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            print(spec, seed, round(rec["auto_nrmse"], 4),
                  [(r["M"], r["noise_factor"], round(r["nrmse"], 4), round(r["seconds"], 2)) for r in rec["refits"]],
                  flush=True)
    cols = [(f, nf) for f in args.factors for nf in (args.noise_factors if f in args.noise_at else [1.0])]
    head = ["dataset", "seed", "auto_fit NRMSE (M)", "level M", "centers"] + [
        f"{f:g} M" + ("" if nf == 1.0 else f", noise x{nf:g}") for f, nf in cols]
    rows = []
    for r in recs:
        by = {(x["factor"], x["noise_factor"]): x for x in r["refits"]}
        rows.append([r["dataset"], r["seed"], f"{r['auto_nrmse']:.4g} ({r['auto_M']})", r["level_M"],
                     r["level_centers"]] + [
            f"{by[c]['nrmse']:.4g} / {by[c]['seconds']:.2g} s" if c in by else "-" for c in cols])
    body = ["Each refit: the final model's kernel, on its rows (training plus held-out), uniform nested centers "
            "(prefixes of one permutation of those rows), penalty = the level's times the noise factor, "
            "max_iter 50, tol 1e-4, the data dtype of the run (float32).", "",
            markdown_table(head, rows), "", f"Total {time.perf_counter() - t0:.0f} s."]
    write_result(out, "auto_fit's chosen level refitted with more centers (test NRMSE / refit wall s)", env,
                 "\n".join(body))


if __name__ == "__main__":
    main()
