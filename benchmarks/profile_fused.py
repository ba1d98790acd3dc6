"""The Matern kernel profiles ``phi`` in one vectorised pass (``gpfalkon.backend.fused.fused_profile_``) against
the engine's ATen operations (``engine._apply_profile_`` with the fused kernels off).

Per profile (Matern-1/2, 3/2, 5/2) and dtype: nanoseconds per value on a cache-resident buffer of 512 KiB
(one thread's share of a fly-kernel tile) on one thread, and on a 64 MiB buffer on all of torch's threads;
each timing refills the buffer from a source of squared scaled distances (the refill's own time is
measured alone and subtracted); median of ``--repeats`` after a warm-up, arms alternated. 'max rel. err.'
is the largest relative difference from ``phi`` computed in float64 by ATen on the same inputs (the
dtype's values; results above its smallest normal number). Then the end-to-end effect on the pass whose
cost the profile dominates outside the fused tile kernel, ``KernelEngine.k_matmul`` (``K_nM u``: the
posterior mean; n = 200,000, M = 2,000, X ~ N(0, I_d), lengthscale sqrt(d)), with the fused kernels on and
off (which, in this pass, switches only the profile), alternated, median of 9.

    .venv/bin/python benchmarks/profile_fused.py --out benchmarks/results/profile-fused.md
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon.backend import fused
from gpfalkon.backend.engine import _apply_profile_

from _common import environment_lines, log, markdown_table, write_result

KINDS = ("matern12", "matern32", "matern52")


def source(kind: str, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Squared scaled distances ``t >= 0`` as the engine holds them for a Matern profile."""
    g = torch.Generator().manual_seed(count)
    return (torch.rand(count, generator=g, dtype=torch.float64) * 40).to(dtype)


def k_matmul_rows(repeats: int) -> list[list]:
    """``KernelEngine.k_matmul`` with the fused profile and with ATen's, alternated (module docstring)."""
    import math

    import gpytorch

    from gpfalkon import KernelEngine

    rows = []
    for dtype in (torch.float32, torch.float64):
        for nu, d in ((2.5, 8), (2.5, 20), (0.5, 8)):
            base = gpytorch.kernels.MaternKernel(nu=nu)
            base.lengthscale = math.sqrt(d)
            g = torch.Generator().manual_seed(d)
            x = torch.randn(200_000, d, generator=g).to(dtype)
            eng = KernelEngine(gpytorch.kernels.ScaleKernel(base).to(dtype), x, x[:2000].clone(), store=False)
            a = torch.randn(2000, 1, generator=g).to(dtype)
            times: dict[bool, list[float]] = {True: [], False: []}
            outs = {}
            for rep in range(repeats + 1):
                for on in ((True, False) if rep % 2 else (False, True)):
                    fused.set_enabled(on)
                    t0 = time.perf_counter()
                    outs[on] = eng.k_matmul(a)
                    if rep:
                        times[on].append(time.perf_counter() - t0)
            fused.set_enabled(None)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            diff = float((outs[True] - outs[False]).abs().max() / outs[False].abs().max())
            name = {0.5: "matern12", 1.5: "matern32", 2.5: "matern52"}[nu]
            rows.append([str(dtype)[6:], name, d, off, on, off / on, diff])
            log(f"k_matmul {dtype} nu={nu} d={d}: ATen {off:.3f} s, fused {on:.3f} s ({off / on:.2f}x)")
    return rows


def per_value_ns(fn, buf: torch.Tensor, src: torch.Tensor, repeats: int, inner: int) -> float:
    """Median over ``repeats`` of (``inner`` x (refill + fn)) / inner / values, in ns."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            buf.copy_(src)
            fn(buf)
        times.append((time.perf_counter() - t0) / inner / buf.numel() * 1e9)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    ok, why = fused.fused_available()
    if not ok:
        raise SystemExit(f"the fused kernels are unavailable: {why}")
    env = environment_lines()
    threads = torch.get_num_threads()
    rows = []
    for dtype in (torch.float32, torch.float64):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for kind in KINDS:
            inputs = source(kind, 1 << 20, dtype)
            fused.set_enabled(False)  # the references: ATen's operations
            exact = inputs.to(torch.float64, copy=True)
            want = _apply_profile_(kind, exact, torch.empty_like(exact))
            aten = _apply_profile_(kind, inputs.clone(), torch.empty_like(inputs))
            fused.set_enabled(None)
            got = inputs.clone()
            assert fused.fused_profile_(got, kind)
            big = want > torch.finfo(dtype).tiny
            err = {name: float(((v.double() - want).abs() / want)[big].max()) for name, v in
                   (("fused", got), ("aten", aten))}
            for label, nbytes, nthreads, inner in (("512 KiB, 1 thread", 2**19, 1, 200),
                                                   (f"64 MiB, {threads} threads", 2**26, threads, 3)):
                torch.set_num_threads(nthreads)
                src = source(kind, nbytes // itemsize, dtype)
                buf, tmp = src.clone(), torch.empty_like(src)

                def run_aten(b: torch.Tensor, kind: str = kind, tmp: torch.Tensor = tmp) -> None:
                    fused.set_enabled(False)
                    _apply_profile_(kind, b, tmp)
                    fused.set_enabled(None)

                def run_fused(b: torch.Tensor, kind: str = kind) -> None:
                    fused.fused_profile_(b, kind)

                arms = {"aten": [], "fused": [], "refill": []}
                fns = {"aten": run_aten, "fused": run_fused, "refill": lambda b: None}
                for fn in fns.values():
                    per_value_ns(fn, buf, src, 1, inner)
                for _ in range(args.repeats):
                    for name, fn in fns.items():
                        arms[name].append(per_value_ns(fn, buf, src, 1, inner))
                refill = statistics.median(arms["refill"])
                a = statistics.median(arms["aten"]) - refill
                f = statistics.median(arms["fused"]) - refill
                rows.append([str(dtype)[6:], kind, label, a, f, a / f, err["aten"], err["fused"]])
                log(f"{dtype} {kind} {label}: aten {a:.3f} ns, fused {f:.3f} ns ({a / f:.2f}x)")
            torch.set_num_threads(threads)
    passes = k_matmul_rows(9)
    body = (f"Median of {args.repeats} after a warm-up, arms alternated; the refill's time (measured alone in the "
            "same rounds) subtracted. 'max rel. err.': against phi computed in float64 by ATen on the same "
            "inputs (the dtype's values), over results above its smallest normal number.\n\n"
            + markdown_table(["dtype", "profile", "buffer", "ATen ns / value", "fused ns / value", "speed-up",
                              "max rel. err. ATen", "max rel. err. fused"], rows, align="lll" + "r" * 5)
            + "\n\n`KernelEngine.k_matmul` (n = 200,000, M = 2,000), seconds, median of 9, alternated; 'rel. diff' = "
            "max |out_fused - out_ATen| / max |out_ATen|:\n\n"
            + markdown_table(["dtype", "kernel", "d", "ATen profile s", "fused profile s", "speed-up", "rel. diff"],
                             passes, align="llr" + "r" * 4))
    if args.out is not None:
        write_result(args.out, "The kernel profile in one vectorised pass vs ATen's in-place operations", env, body)
        log(f"written {args.out}")
    else:
        print(body)


if __name__ == "__main__":
    main()
