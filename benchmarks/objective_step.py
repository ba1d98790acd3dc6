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

``--compare whole`` times instead, on the default route, the pass as the library runs it now (its
graph kept where ``n M`` x 48 bytes fits an eighth of the memory budget, or where it is one block:
:func:`gpfalkon.backend.keeps_graph`) against the pass before that rule (every block checkpointed),
in turn within each repetition.

    .venv/bin/python benchmarks/objective_step.py --out benchmarks/results/objective-step.md
    .venv/bin/python benchmarks/objective_step.py --compare whole --out benchmarks/results/objective-step-whole.md
"""
from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import statistics
import sys
import time

import torch
from gpytorch.kernels import MaternKernel, ScaleKernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon.backend.passes as passes
from gpfalkon import FalkonGP, settings
from gpfalkon.objectives import GCV, NystromCompReg, SGPRBound

from _common import environment_lines, log, markdown_table, write_result

OBJECTIVES = {"GCV": GCV, "SGPRBound": SGPRBound, "NystromCompReg": NystromCompReg}
WHOLE_SHAPES = ["2000x300x17", "4000x300x17", "8000x300x17", "16000x300x9", "32000x300x9", "8000x1000x8"]
SHAPES = ["2000x300x32", "4000x300x32", "8000x300x13", "16000x300x8", "16000x500x4", "8000x1000x8"]


def make_model(n: int, m: int, d: int, dtype: torch.dtype) -> FalkonGP:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    kernel = ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d)).to(dtype)
    with torch.no_grad():
        kernel.base_kernel.lengthscale = torch.full((1, d), math.sqrt(d), dtype=dtype)
    return FalkonGP(x.to(dtype), y.to(dtype), kernel=kernel, centers=x[:m].to(dtype).clone(), penalty=1e-3 / n)


@contextlib.contextmanager
def variant(name: str):
    """``solve`` / ``gram``: that aggregate route; ``whole``: the library's default; ``blocked``: the pass
    before the graph-keeping rule (every block checkpointed)."""
    if name in ("solve", "gram"):
        with settings.aggregate_route(name):
            yield
        return
    if name == "whole":
        yield
        return
    real = passes._keep_graph
    passes._keep_graph = lambda *args: False
    try:
        yield
    finally:
        passes._keep_graph = real


def value_and_grad(model: FalkonGP, cls: type, route: str) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    with variant(route):
        loss = cls(model)()
        loss.backward()
    grads = [p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), torch.cat(grads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=None, help="n x M x d, e.g. 4000x300x32")
    ap.add_argument("--compare", choices=["routes", "whole"], default="routes",
                    help="routes: solve vs gram; whole: every block checkpointed vs the graph kept")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/objective-step.md"))
    args = ap.parse_args()
    pair = ("solve", "gram") if args.compare == "routes" else ("blocked", "whole")
    shapes = args.shapes or (SHAPES if args.compare == "routes" else WHOLE_SHAPES)
    env = environment_lines()
    t_start = time.perf_counter()
    rows = []
    for shape in shapes:
        n, m, d = (int(v) for v in shape.lower().split("x"))
        model = make_model(n, m, d, torch.float32)
        ref_model = make_model(n, m, d, torch.float64)
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        for name, cls in OBJECTIVES.items():
            ref_v, ref_g = value_and_grad(ref_model, cls, "solve")
            diffs = {}
            for route in pair:
                v, gr = value_and_grad(model, cls, route)
                diffs[route] = (abs(v - ref_v) / abs(ref_v), float((gr - ref_g).norm() / ref_g.norm()))
            opt = torch.optim.Adam(params, lr=0.01)
            times: dict[str, list[float]] = {route: [] for route in pair}
            for rep in range(args.repeats + 1):
                for route in pair:
                    with torch.no_grad():
                        for p, s in zip(params, start, strict=True):
                            p.copy_(s)
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    with variant(route):
                        cls(model)().backward()
                    opt.step()
                    if rep:  # the first repetition warms up
                        times[route].append(time.perf_counter() - t0)
            a, b = statistics.median(times[pair[0]]), statistics.median(times[pair[1]])
            rows.append([shape, name, 1e3 * a, 1e3 * b, a / b, f"{diffs[pair[0]][0]:.1e} / {diffs[pair[1]][0]:.1e}",
                         f"{diffs[pair[0]][1]:.1e} / {diffs[pair[1]][1]:.1e}"])
            log(f"{shape} {name}: {pair[0]} {1e3 * a:.1f} ms, {pair[1]} {1e3 * b:.1f} ms")
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
    speedups = [r[4] for r in rows]
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    a_, b_ = pair
    what = ("the two routes" if args.compare == "routes" else
            "every block checkpointed (before) and the graph kept (now), default route (gram), 2048-row blocks")
    body = (
        f"float32 data; {args.repeats} repetitions after one warm-up, {what} timed in turn; ms = median "
        "per Adam step (value, backward, step).\n\n"
        + markdown_table(["n x M x d", "objective", f"{a_} ms", f"{b_} ms", "speed-up", f"value diff {a_} / {b_}",
                          f"grad diff {a_} / {b_}"], rows)
        + f"\n\nGeometric mean speed-up {geo:.2f}x over {len(rows)} cases; {sum(s > 1 for s in speedups)} of "
        f"{len(rows)} faster. Diffs: relative to the float64 solve route on the same data and parameters."
        + f"\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    title = ("Objective step: Gram route vs solve route of the aggregates" if args.compare == "routes" else
             "Objective step: checkpointed blocks vs the kept graph of the aggregates")
    path = write_result(args.out, title, env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
