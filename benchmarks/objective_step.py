"""One Adam step of the exact objectives: the Gram route of the aggregates against the solve route.

For each shape ``(n, M, d)`` a float32 ``FalkonGP`` (Matern-5/2 ARD kernel, every lengthscale
``sqrt(d)``, M centers drawn from the n standard-normal rows, targets ``sin(x_1)`` plus noise) is
built once; for each objective (GCV, SGPRBound, NystromCompReg) one step = ``zero_grad``, the
objective's value, ``backward`` and ``Adam.step``. The two routes
(``gpfalkon.settings.aggregate_route``: ``"solve"`` = a triangular solve per row block, ``"gram"`` =
float64 ``K_Mb K_bM`` per block and one whitening) are timed in turn within each repetition, from
the same parameters (restored before every step). ms = median; 'value diff' and 'grad diff' compare
the two routes' objective values and gradients against a float64 evaluation of the solve route
(relative), so they show each route's float32 error, not only their difference.

    .venv/bin/python benchmarks/objective_step.py --out benchmarks/results/objective-step.md
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time

import torch
from gpytorch.kernels import MaternKernel, ScaleKernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon import FalkonGP, settings
from gpfalkon.objectives import GCV, NystromCompReg, SGPRBound

from _common import environment_lines, log, markdown_table, write_result

OBJECTIVES = {"GCV": GCV, "SGPRBound": SGPRBound, "NystromCompReg": NystromCompReg}
SHAPES = ["2000x300x32", "4000x300x32", "8000x300x13", "16000x300x8", "16000x500x4", "8000x1000x8"]


def make_model(n: int, m: int, d: int, dtype: torch.dtype) -> FalkonGP:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    kernel = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d)).to(dtype)
    with torch.no_grad():
        kernel.base_kernel.lengthscale = torch.full((1, d), math.sqrt(d), dtype=dtype)
    return FalkonGP(x.to(dtype), y.to(dtype), kernel=kernel, centers=x[:m].to(dtype).clone(), penalty=1e-3 / n)


def value_and_grad(model: FalkonGP, cls: type, route: str) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    with settings.aggregate_route(route):
        loss = cls(model)()
        loss.backward()
    grads = [p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), torch.cat(grads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="n x M x d, e.g. 4000x300x32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/objective-step.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    rows = []
    for shape in args.shapes:
        n, m, d = (int(v) for v in shape.lower().split("x"))
        model = make_model(n, m, d, torch.float32)
        ref_model = make_model(n, m, d, torch.float64)
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        for name, cls in OBJECTIVES.items():
            ref_v, ref_g = value_and_grad(ref_model, cls, "solve")
            diffs = {}
            for route in ("solve", "gram"):
                v, gr = value_and_grad(model, cls, route)
                diffs[route] = (abs(v - ref_v) / abs(ref_v), float((gr - ref_g).norm() / ref_g.norm()))
            opt = torch.optim.Adam(params, lr=0.01)
            times: dict[str, list[float]] = {"solve": [], "gram": []}
            for rep in range(args.repeats + 1):
                for route in ("solve", "gram"):
                    with torch.no_grad():
                        for p, s in zip(params, start, strict=True):
                            p.copy_(s)
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    with settings.aggregate_route(route):
                        cls(model)().backward()
                    opt.step()
                    if rep:  # the first repetition warms up
                        times[route].append(time.perf_counter() - t0)
            a, b = statistics.median(times["solve"]), statistics.median(times["gram"])
            rows.append([shape, name, 1e3 * a, 1e3 * b, a / b, f"{diffs['solve'][0]:.1e} / {diffs['gram'][0]:.1e}",
                         f"{diffs['solve'][1]:.1e} / {diffs['gram'][1]:.1e}"])
            log(f"{shape} {name}: solve {1e3 * a:.1f} ms, gram {1e3 * b:.1f} ms")
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
    speedups = [r[4] for r in rows]
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    body = (
        f"float32 data; {args.repeats} repetitions after one warm-up, the two routes timed in turn; ms = median "
        "per Adam step (value, backward, step).\n\n"
        + markdown_table(["n x M x d", "objective", "solve ms", "gram ms", "speed-up", "value diff solve / gram",
                          "grad diff solve / gram"], rows)
        + f"\n\nGeometric mean speed-up {geo:.2f}x over {len(rows)} cases; {sum(s > 1 for s in speedups)} of "
        f"{len(rows)} faster. Diffs: relative to the float64 solve route on the same data and parameters."
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "Objective step: Gram route vs solve route of the aggregates", env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
