"""The first pass of a stored-``K_nM`` fit with and without ``gpfalkon.settings.prefault_stores``.

A FALKON fit (Gaussian kernel, ``--m`` centers, ``--iterations`` CG iterations, float32, synthetic inputs
with ``--d`` coordinates) whose ``K_nM`` is stored: its first pass computes ``K_nM`` into a fresh host store
(and ``K_Mn y``). With the setting on (the default) the store is zero filled first (its pages faulted in by
torch's parallel fill), off the fused C++ pass takes the page faults itself. Each fit runs in its own fresh
process (a process's first store is what a user's first fit gets), the two variants alternating, at each
``--rows``. Reported: the first pass (the fit's seconds less its CG and preconditioner), the whole fit, the
process's system CPU seconds and minor page faults during the fit (``getrusage``), medians over
``--processes`` processes per variant.

    .venv/bin/python benchmarks/store_prefault.py --out benchmarks/results/store-prefault.md
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import environment_lines, log, markdown_table, write_result

VARIANTS = {"zero fill first (prefault_stores on)": True, "faults in the fused pass (off)": False}


def child(prefault: bool, n: int, m: int, d: int, iterations: int) -> dict:
    """One fit in this (fresh) process: its timings and ``getrusage`` deltas."""
    import resource
    import time

    import gpytorch
    import torch

    import gpfalkon
    from gpfalkon.backend.blocks import memory_budget_for
    from gpfalkon.backend.engine import stored_rows_for

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    y = torch.sin(x[:, :3].sum(-1)) + 0.1 * torch.randn(n, generator=g)
    centers = x[torch.randperm(n, generator=g)[:m]]
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
    kernel.base_kernel.lengthscale = float(d) ** 0.5
    model = gpfalkon.FalkonGP(x, y, kernel=kernel, centers=centers, penalty=1e-6, max_iter=iterations, tol=0.0)
    stored = stored_rows_for(n, m, 4, memory_budget_for())
    with gpfalkon.settings.prefault_stores(prefault):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        model.fit()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    extra = model.fit_info.extra
    first = extra["fit_seconds"] - extra["cg_seconds"] - extra["preconditioner_seconds"]
    return dict(first=first, fit=wall, cg=extra["cg_seconds"], sys=r1.ru_stime - r0.ru_stime,
                user=r1.ru_utime - r0.ru_utime, faults=r1.ru_minflt - r0.ru_minflt, stored=stored,
                iterations=int(model.fit_info.iterations))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_430_000])
    ap.add_argument("--m", type=int, default=2_000)
    ap.add_argument("--d", type=int, default=9)
    ap.add_argument("--iterations", type=int, default=15)
    ap.add_argument("--processes", type=int, default=3, help="fresh processes per variant and size")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/store-prefault.md"))
    args = ap.parse_args()
    if args.child:
        prefault, n = json.loads(args.child)
        print(json.dumps(child(bool(prefault), int(n), args.m, args.d, args.iterations)))
        return
    env = environment_lines()
    runs: dict[tuple[int, str], list[dict]] = {}
    for n in args.rows:
        for p in range(args.processes):
            order = list(VARIANTS) if p % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps([VARIANTS[variant], n]),
                                      "--m", str(args.m), "--d", str(args.d), "--iterations", str(args.iterations)],
                                     capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                runs.setdefault((n, variant), []).append(res)
                log(f"[{n:,} rows, {variant}] {res}")
    rows = []
    for (n, variant), res in runs.items():
        med = {k: statistics.median(r[k] for r in res) for k in ("first", "fit", "cg", "sys", "faults")}
        rows.append([f"{n:,}", f"{res[0]['stored'] * args.m * 4 / 1e9:.2f}", variant, med["first"], med["fit"],
                     med["cg"], med["sys"], f"{med['faults']:,.0f}",
                     f"{1e6 * med['sys'] / max(med['faults'], 1):.2f}"])
    ratios = []
    for n in args.rows:
        on, off = (runs[(n, v)] for v in VARIANTS)
        first_ratio = statistics.median(r["first"] for r in off) / statistics.median(r["first"] for r in on)
        fit_ratio = statistics.median(r["fit"] for r in off) / statistics.median(r["fit"] for r in on)
        ratios.append(f"- {n:,} rows: the first pass {first_ratio:.2f}x, the whole fit {fit_ratio:.2f}x faster "
                      "with the zero fill (medians; > 1 favours it)")
    body = [f"FALKON fits, float32, d = {args.d}, M = {args.m:,}, Gaussian kernel, {args.iterations} CG iterations, "
            f"K_nM stored (the GB column: its stored rows); {args.processes} fresh processes per variant and size, "
            "alternating; medians. 'first pass s': the fit's seconds less its CG and its preconditioner (computing "
            "K_nM into the store and K_Mn y; with the zero fill, the fill included). 'sys s' and 'minor faults': "
            "getrusage over the fit (both threads).", "",
            markdown_table(["rows", "stored GB", "variant", "first pass s", "fit s", "CG s", "sys s", "minor faults",
                            "sys us / fault"], rows, align="rrlrrrrrr"), "", *ratios, "",
            "Each process (first pass s / fit s / sys s), in run order:", ""]
    for (n, variant), res in runs.items():
        body.append(f"- {n:,} rows, {variant}: " + " | ".join(
            f"{r['first']:.2f} / {r['fit']:.2f} / {r['sys']:.2f}" for r in res))
    path = write_result(args.out, "Zero filling a fresh K_nM store before the fused first pass", env, "\n".join(body))
    log(f"written {path}")


if __name__ == "__main__":
    main()
