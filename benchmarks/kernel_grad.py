"""The hand-written kernel block (``gpfalkon.settings.fast_kernel_grad``) against autograd through GPyTorch.

Part 1, the block alone: for each kernel (RBF, Matern 3/2, Matern 5/2; ARD, in a ``ScaleKernel``) and shape
``rows x M x d`` (float32, standard-normal rows, lengthscales ``sqrt(d)``), the time of ``K = k(X, C)`` and its
backward for an upstream gradient ``G`` w.r.t. the points and the raw parameters, both ways in turn within each
repetition.
Part 2, one Adam step of the exact objectives the hyperparameter search runs (GCV, SGPRBound; float32 model of
:func:`objective_step.make_model`, the default aggregate route), both ways in turn. ms = median; the diffs are
relative to the same quantity through GPyTorch in float64 (so they show each way's float32 error).

    .venv/bin/python benchmarks/kernel_grad.py --out benchmarks/results/kernel-grad.md
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time

import torch
from gpytorch.kernels import MaternKernel, RBFKernel, ScaleKernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from objective_step import make_model

from gpfalkon import settings
from gpfalkon.backend.stationary_grad import grad_kernel_block
from gpfalkon.objectives import GCV, SGPRBound

from _common import environment_lines, log, markdown_table, write_result

BLOCK_SHAPES = ["2000x300x26", "4000x300x17", "16000x300x8", "8000x1000x8"]
STEP_SHAPES = ["2000x300x26", "4000x300x17", "8000x300x13", "8000x1000x8"]
KERNELS = {"rbf": lambda d: ScaleKernel(RBFKernel(ard_num_dims=d)),
           "matern32": lambda d: ScaleKernel(MaternKernel(nu=1.5, ard_num_dims=d)),
           "matern52": lambda d: ScaleKernel(MaternKernel(nu=2.5, ard_num_dims=d))}
WAYS = {"gpytorch": False, "ours": True}


def block_backward(kernel, x: torch.Tensor, c: torch.Tensor, up: torch.Tensor, fast: bool) -> list[torch.Tensor]:
    """The block and every gradient of ``<K, up>`` (the timed part: forward and backward)."""
    x = x.detach().requires_grad_(True)
    c = c.detach().requires_grad_(True)
    kernel.zero_grad()
    with settings.fast_kernel_grad(fast):
        k = grad_kernel_block(kernel, x, c)
        k.backward(up)
    return [k.detach(), x.grad, c.grad] + [p.grad for p in kernel.parameters()]


def block_grads(kernel, x: torch.Tensor, c: torch.Tensor, up: torch.Tensor, fast: bool) -> torch.Tensor:
    """:func:`block_backward`'s tensors flattened into one float64 vector."""
    return torch.cat([t.reshape(-1).double() for t in block_backward(kernel, x, c, up, fast)])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def part_block(shapes: list[str], repeats: int) -> list[list]:
    rows = []
    for shape in shapes:
        n, m, d = (int(v) for v in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, d, generator=g)
        c = x[:m].clone() + 0.01
        up = torch.randn(n, m, generator=g)
        for name, make in KERNELS.items():
            kernel = make(d)
            with torch.no_grad():
                kernel.base_kernel.lengthscale = torch.full((1, d), math.sqrt(d))
            ref = block_grads(kernel.double(), x.double(), c.double(), up.double(), False)
            kernel.float()
            diffs = {w: rel(block_grads(kernel, x, c, up, f), ref) for w, f in WAYS.items()}
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for rep in range(repeats + 1):
                for w, f in WAYS.items():
                    t0 = time.perf_counter()
                    block_backward(kernel, x, c, up, f)
                    if rep:
                        times[w].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[w]) for w in WAYS)
            rows.append([shape, name, 1e3 * a, 1e3 * b, a / b, f"{diffs['gpytorch']:.1e} / {diffs['ours']:.1e}"])
            log(f"block {shape} {name}: gpytorch {1e3 * a:.2f} ms, ours {1e3 * b:.2f} ms")
    return rows


def step_value_grad(model, cls, fast: bool) -> torch.Tensor:
    model.zero_grad()
    with settings.fast_kernel_grad(fast):
        loss = cls(model)()
        loss.backward()
    return torch.cat([loss.detach().reshape(-1).double()]
                     + [p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def part_step(shapes: list[str], repeats: int) -> list[list]:
    rows = []
    for shape in shapes:
        n, m, d = (int(v) for v in shape.split("x"))
        model = make_model(n, m, d, torch.float32)
        ref_model = make_model(n, m, d, torch.float64)
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        for cname, cls in {"GCV": GCV, "SGPRBound": SGPRBound}.items():
            ref = step_value_grad(ref_model, cls, False)
            diffs = {w: rel(step_value_grad(model, cls, f), ref) for w, f in WAYS.items()}
            opt = torch.optim.Adam(params, lr=0.01)
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for rep in range(repeats + 1):
                for w, f in WAYS.items():
                    with torch.no_grad():
                        for p, s in zip(params, start, strict=True):
                            p.copy_(s)
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    with settings.fast_kernel_grad(f):
                        cls(model)().backward()
                    opt.step()
                    if rep:
                        times[w].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[w]) for w in WAYS)
            rows.append([shape, cname, 1e3 * a, 1e3 * b, a / b, f"{diffs['gpytorch']:.1e} / {diffs['ours']:.1e}"])
            log(f"step {shape} {cname}: gpytorch {1e3 * a:.1f} ms, ours {1e3 * b:.1f} ms")
        with torch.no_grad():
            for p, s in zip(params, start, strict=True):
                p.copy_(s)
    return rows


def geo(rows: list[list]) -> str:
    s = [r[4] for r in rows]
    return f"geometric mean speed-up {math.exp(sum(map(math.log, s)) / len(s)):.2f}x over {len(s)} cases"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block-shapes", nargs="+", default=BLOCK_SHAPES)
    ap.add_argument("--step-shapes", nargs="+", default=STEP_SHAPES)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/kernel-grad.md"))
    args = ap.parse_args()
    env = environment_lines()
    t_start = time.perf_counter()
    block = part_block(args.block_shapes, args.repeats)
    step = part_step(args.step_shapes, args.repeats)
    head = ["rows x M x d", "{}", "gpytorch ms", "ours ms", "speed-up", "rel. diff gpytorch / ours"]
    body = (
        f"float32; {args.repeats} repetitions after one warm-up, the two ways timed in turn; ms = median.\n\n"
        "## The block: `K = k(X, C)` and its backward for an upstream gradient `G` (points and raw parameters)\n\n"
        + markdown_table([h.format("kernel") for h in head], block)
        + f"\n\n{geo(block)}. Diff: the block and all gradients, against GPyTorch in float64.\n\n"
        "## One Adam step of the objective (value, backward, step), Matern 5/2 ARD\n\n"
        + markdown_table([h.format("objective") for h in head], step)
        + f"\n\n{geo(step)}. Diff: the value and the gradient w.r.t. every parameter, against GPyTorch in "
        f"float64.\n\nTotal benchmark time {time.perf_counter() - t_start:.0f} s."
    )
    path = write_result(args.out, "Kernel block gradients: hand-written backward vs autograd through GPyTorch",
                        env, body)
    log(f"written to {path}")


if __name__ == "__main__":
    main()
