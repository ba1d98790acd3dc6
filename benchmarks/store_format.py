"""A stored ``K_nM`` in fewer bytes: the test error of rounded formats, and the speed of the int16 store.

Part 1, accuracy (``--part accuracy``): on ``fit.py``'s reference problem (synthetic, d = 20, RBF with the
median-heuristic lengthscale, M uniform centers), the Nyström system of the stored ``K_nM`` rounded to a format
is solved directly in float64 (``(K~ᵀ K~ + nλ K_MM) α = K~ᵀ y``; predictions ``k(x_*, C) α`` unrounded), so the
test RMSE measures the format alone, without CG's iterations: float32, float16, bfloat16, and 16-bit fixed point
with one scale per row (``gpfalkon.settings.store_format("int16")``) or one for the whole matrix, at each
``--sizes`` x ``--penalties``.

Part 2, speed (``--part speed``): one ``K_nM^T (K_nM u)`` with the whole ``K_nM`` stored (the engine's fused CPU
kernel), in the data's dtype and in int16, float32 and float64, after one warm-up: seconds, the bytes of the
store read per second, and that rate over ``torch.sum``'s read rate of a 1 GiB buffer measured in the same run;
and the first pass (filling the store: kernel values, rounding, the store's fresh memory).

    .venv/bin/python benchmarks/store_format.py --out benchmarks/results/store-int16.md
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fit import make_kernel, rmse, synthetic

import gpfalkon
from gpfalkon import KernelEngine, median_lengthscale, uniform_centers
from gpfalkon.backend import fused

from _common import environment_lines, log, markdown_table, read_bandwidth, write_result

FORMATS = ("float64", "float32", "float16", "bfloat16", "int16, row scales", "int16, one scale")


def rounded(k: torch.Tensor, fmt: str) -> torch.Tensor:
    """``k`` (float64) as the format stores it, back in float64."""
    if fmt == "float64":
        return k
    if fmt in ("float32", "float16", "bfloat16"):
        return k.to(getattr(torch, fmt)).double()
    if fmt == "int16, row scales":
        s = k.abs().amax(1, keepdim=True) / 32767
    else:
        s = torch.full((1, 1), float(k.abs().max()) / 32767, dtype=k.dtype)
    return torch.where(s > 0, torch.round(k / s), torch.zeros((), dtype=k.dtype)) * s


def accuracy_part(args, notes: list[str]) -> str:
    rows = []
    for n in args.sizes:
        xtr, ytr, xte, yte, fte = synthetic(n, args.n_test, 20, args.seed)
        ls = float(median_lengthscale(xtr))
        idx = uniform_centers(xtr, args.m, torch.Generator().manual_seed(args.seed)).indices
        c = xtr[idx].clone()
        kern = make_kernel("rbf", ls, torch.float64)
        knm = KernelEngine(kern, xtr, c).materialize()
        kmm = KernelEngine(kern, c, c).kmm()
        kte = KernelEngine(kern, xte, c, store=False).materialize()
        for lam in args.penalties:
            base = None
            for fmt in FORMATS:
                kt = rounded(knm, fmt)
                h = kt.T @ kt + n * lam * kmm
                b = kt.T @ ytr
                jitter = 1e-12 * float(h.diagonal().mean())
                alpha = torch.linalg.solve(h + jitter * torch.eye(args.m, dtype=torch.float64), b)
                pred = kte @ alpha
                r, rf = rmse(pred, yte), rmse(pred, fte)
                base = r if base is None else base
                err = float((kt - knm).abs().max())
                rows.append([f"{n:,}", f"{lam:g}", fmt, err, r, rf, r / base - 1.0])
                log(f"  n={n:,} lambda={lam:g} {fmt}: max |K~ - K| {err:.2e}, test RMSE {r:.5f} (vs f {rf:.5f})")
            del kt, h
        del knm, kte
        gc.collect()
    return ("## Test error of the rounded formats (direct float64 solve of each rounded system)\n\n"
            f"Reference problem of `fit.py` (d = 20, RBF, median-heuristic lengthscale), M = {args.m:,} uniform "
            f"centers, {args.n_test:,} test points. 'max |K~ - K|': the largest rounding error of a value "
            "(K's values lie in (0, 1]); 'RMSE change': test RMSE / the float64 row's - 1.\n\n"
            + markdown_table(["n", "lambda", "format", "max abs K~ - K", "test RMSE", "RMSE vs f", "RMSE change"],
                             rows, align="rrl" + "r" * 4))


def speed_part(args, notes: list[str]) -> str:
    ok, why = fused.fused_available()
    if not ok:
        notes.append(f"speed part without the fused kernel: {why}")
    bw = read_bandwidth() * 1e9
    log(f"read rate (torch.sum over 1 GiB float32): {bw / 1e9:.1f} GB/s")
    n, m = args.speed_n, args.m
    xtr, _, _, _, _ = synthetic(n, 10, 20, args.seed)
    ls = float(median_lengthscale(xtr))
    idx = uniform_centers(xtr, m, torch.Generator().manual_seed(args.seed)).indices
    c = xtr[idx].clone()
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        times: dict[str, float] = {}
        for fmt in (None, "int16"):
            firsts, laters = [], []
            for _ in range(args.repeats):
                gc.collect()
                with gpfalkon.settings.store_format(fmt):
                    eng = KernelEngine(make_kernel("rbf", ls, dtype), xtr.to(dtype), c.to(dtype), store=True)
                u = torch.randn(m, 1, dtype=dtype)
                t0 = time.perf_counter()
                eng.kmn_k(u)
                firsts.append(time.perf_counter() - t0)
                eng.kmn_k(u)  # warm-up
                t1 = time.perf_counter()
                for _ in range(args.products):
                    eng.kmn_k(u)
                laters.append((time.perf_counter() - t1) / args.products)
                nbytes = eng._k.numel() * eng._k.element_size() + (0 if eng._scale is None else
                                                                   eng._scale.numel() * eng._scale.element_size())
                eng.release()
                del eng
            first, later = statistics.median(firsts), statistics.median(laters)
            label = name if fmt is None else "int16"
            times[label] = later
            rate = nbytes / later
            rows.append([name, label, f"{nbytes / 1e9:.2f}", first, later, rate / 1e9, rate / bw,
                         times[name] / later])
            log(f"  {name} store {label}: first pass {first:.3f} s, product {later:.4f} s "
                f"({rate / 1e9:.1f} GB/s, {rate / bw:.2f} of the read rate)")
    return (f"## One stored product `K_nM^T (K_nM u)`, n = {n:,}, M = {m:,}, d = 20, RBF (fused CPU kernel: "
            f"{'yes' if ok else 'no'})\n\n"
            f"Read rate measured in this run (torch.sum over a 1 GiB float32 buffer): {bw / 1e9:.1f} GB/s. "
            f"Medians over {args.repeats} engines; 'product s' the mean of {args.products} products after a "
            "warm-up; 'first pass s' the first product, which fills the store (kernel values, rounding, the store's "
            "fresh memory); 'x read rate' = the store's bytes per second over the read rate; 'speed-up' = the "
            "dtype store's product time / this row's.\n\n"
            + markdown_table(["dtype", "store", "store GB", "first pass s", "product s", "GB/s", "x read rate",
                              "speed-up"], rows, align="ll" + "r" * 6))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", choices=["accuracy", "speed"], default=["accuracy", "speed"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[50_000, 200_000], help="accuracy part: n values")
    ap.add_argument("--penalties", nargs="+", type=float, default=[1e-4, 1e-6, 1e-8])
    ap.add_argument("--m", type=int, default=2000, help="centers (default 2,000)")
    ap.add_argument("--n-test", type=int, default=10_000)
    ap.add_argument("--speed-n", type=int, default=200_000)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "float64"], default=["float32", "float64"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--products", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    env = environment_lines()
    for line in env:
        log(line)
    notes: list[str] = []
    t0 = time.perf_counter()
    sections = []
    if "accuracy" in args.part:
        sections.append(accuracy_part(args, notes))
    if "speed" in args.part:
        sections.append(speed_part(args, notes))
    body = "\n\n".join(sections)
    if notes:
        body += "\n\n## Notes\n\n" + "\n".join(f"- {t}" for t in notes)
    body += f"\n\nTotal benchmark time {time.perf_counter() - t0:.0f} s."
    print(body)
    if args.out is not None:
        log(f"written to {write_result(args.out, 'A stored K_nM in fewer bytes (store_format)', env, body)}")


if __name__ == "__main__":
    main()
