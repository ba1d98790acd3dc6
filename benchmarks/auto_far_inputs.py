"""auto_fit on inputs with far rows: a missing-value code or a few rows scaled far out in one feature.

Usage (from the repository root): ``.venv/bin/python benchmarks/auto_far_inputs.py [--budget S] [--out F]``
(default budget 4 s, out ``benchmarks/results/auto-far-inputs.md``).

Data: ``n`` = 4,000 training rows, ``x ~ U[0, 1]^4``, ``y = sin(4 x_0) + x_1^2 + 0.1 e``; test: 2,000 clean rows,
scored against the noise-free ``f`` (NRMSE = RMSE / std f). Each case corrupts feature 0 of a few training rows
(the test rows stay clean), and runs ``auto_fit(budget=S, seed=0)`` twice, one after the other: with the
standardisation's scale cap (``gpfalkon.auto.standardise.OUTLIER_SCALE_RATIO``, the default) and without it (the
cap set to infinity: the plain standard deviation, as before the cap), in float32 (the default) and, for the farthest
rows, in float64. The cap only changes a feature whose standard deviation exceeds ``OUTLIER_SCALE_RATIO`` robust scales
(IQR / 1.349); the clean case is the reference.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon
import gpfalkon.auto.standardise as auto_module

from _common import environment_lines, markdown_table, write_result

HERE = pathlib.Path(__file__).resolve().parent


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(4000, 4, generator=g, dtype=torch.float64)
    y = torch.sin(4 * x[:, 0]) + x[:, 1] ** 2 + 0.1 * torch.randn(4000, generator=g, dtype=torch.float64)
    xt = torch.rand(2000, 4, generator=g, dtype=torch.float64)
    return x, y, xt, torch.sin(4 * xt[:, 0]) + xt[:, 1] ** 2


def _cases(x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out = [("clean", x)]
    coded = x.clone()
    coded[:20, 0] = -9999.0
    out.append(("20 rows: x_0 = -9999 (a missing-value code)", coded))
    for scale in (1e3, 1e4, 1e6):
        far = x.clone()
        far[:5, 0] = far[:5, 0] * scale
        out.append((f"5 rows: x_0 * {scale:g}", far))
    return out


def _run(x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor, ft: torch.Tensor, budget: float,
         dtype: torch.dtype) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    model = gpfalkon.auto_fit(x, y, budget=budget, seed=0, dtype=dtype)
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        pred = model.posterior_mean(xt.to(model.train_inputs[0].dtype)).double()
    return float((pred - ft).square().mean().sqrt() / ft.std()), seconds, int(model.centers.shape[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=float, default=4.0)
    p.add_argument("--out", default=str(HERE / "results" / "auto-far-inputs.md"))
    args = p.parse_args()
    env = environment_lines()
    x, y, xt, ft = _data()
    cap = auto_module.OUTLIER_SCALE_RATIO
    rows = []
    for name, xc in _cases(x):
        q = torch.quantile(xc[:, 0], torch.tensor([0.25, 0.75], dtype=torch.float64))
        ratio = float(xc[:, 0].std() / ((q[1] - q[0]) / 1.349))
        dtypes = [torch.float32] + ([torch.float64] if name.endswith("1e+06") or "9999" in name else [])
        for dtype in dtypes:
            res = {}
            for arm, value in (("capped", cap), ("uncapped", math.inf)):
                auto_module.OUTLIER_SCALE_RATIO = value
                try:
                    res[arm] = _run(xc, y, xt, ft, args.budget, dtype)
                finally:
                    auto_module.OUTLIER_SCALE_RATIO = cap
                print(name, str(dtype), arm, res[arm], flush=True)
            rows.append([name, f"{ratio:.3g}", str(dtype).replace("torch.", ""),
                         f"{res['capped'][0]:.4f}", f"{res['capped'][1]:.1f}", f"{res['uncapped'][0]:.4f}",
                         f"{res['uncapped'][1]:.1f}"])
    table = markdown_table(["case (training rows; test rows clean)", "std / robust scale of x_0", "dtype",
                            f"NRMSE, cap {cap:g}", "s", "NRMSE, no cap", "s"], rows)
    body = (f"auto_fit(budget={args.budget:g}, seed=0) on 4,000 rows of `y = sin(4 x_0) + x_1^2 + 0.1 e`, "
            "x ~ U[0,1]^4; test NRMSE against the noise-free f on 2,000 clean rows. 'no cap': the standardisation's "
            "plain standard deviation (OUTLIER_SCALE_RATIO = inf).\n\n" + table)
    print(write_result(pathlib.Path(args.out), "auto_fit with far rows in a feature", env, body))


if __name__ == "__main__":
    main()
