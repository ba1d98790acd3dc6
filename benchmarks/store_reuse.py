"""A penalty sweep of FALKON fits with and without ``gpfalkon.backend.engine.reuse_stores`` (auto_fit's selection
fits: one number of centers, one kernel, several noises).

Per dataset and number of centers, each variant runs in its own fresh process (``--processes`` per variant,
alternating): standardised training rows (at most ``--rows``), the Matern-5/2 kernel at lengthscale 3, ``M``
uniform centers, ``FalkonOptions(preconditioner=FactorCache())`` as ``auto_fit``, 25 CG iterations, then fits at
eight noises. Reported: the median over fits 2-8 (the first pays one-off costs in both) and whether the two
variants' coefficients agree bit for bit.

    .venv/bin/python benchmarks/store_reuse.py --out benchmarks/results/store-reuse.md
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

HERE = pathlib.Path(__file__).resolve().parent

NOISES = (0.01, 0.0025, 0.04, 0.01, 0.005, 0.02, 0.03, 0.001)


def child(name: str, m: int, rows: int, reuse: bool) -> dict:
    import contextlib
    import hashlib
    import time
    import warnings

    import torch

    from gpfalkon import FalkonGP, FalkonOptions
    from gpfalkon.auto.kernels import KERNEL_FAMILIES
    from gpfalkon.backend.engine import reuse_stores
    from gpfalkon.operators import FactorCache

    from compare import load_dataset

    d = load_dataset(name)
    x = torch.as_tensor(d["xtr"]).double()
    x = ((x - x.mean(0)) / x.std(0).clamp_min(1e-12)).float()
    y = torch.as_tensor(d["ytr"]).double()
    y = ((y - y.mean()) / y.std()).float()
    n = min(rows, x.shape[0])
    x, y = x[:n], y[:n]
    kernel = KERNEL_FAMILIES["matern52"](x.shape[1])
    with torch.no_grad():
        kernel.base_kernel.lengthscale = torch.full((1, x.shape[1]), 3.0)
    opts = FalkonOptions(preconditioner=FactorCache())
    centers = x[torch.randperm(n, generator=torch.Generator().manual_seed(0))[:m]].clone()
    seconds, digest = [], hashlib.sha256()
    warnings.simplefilter("ignore")
    with reuse_stores() if reuse else contextlib.nullcontext():
        for noise in NOISES:
            t = time.perf_counter()
            model = FalkonGP(x, y, kernel=kernel, centers=centers, penalty=noise / n, max_iter=25, tol=1e-4,
                             options=opts).fit()
            seconds.append(time.perf_counter() - t)
            digest.update(model.alpha.numpy().tobytes())
            del model
    return dict(seconds=seconds, digest=digest.hexdigest(), n=n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["keggdirected:1000", "protein:2000", "kin40k:1000"])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "store-reuse.md")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        name, m, reuse = args.child
        print(json.dumps(child(name, int(m), args.rows, reuse == "1")))
        return
    rows_out, notes = [], []
    for case in args.cases:
        name, m = case.split(":")
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for i in range(args.processes):
            for reuse in ((False, True) if i % 2 == 0 else (True, False)):
                out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--child", name, m,
                                      "1" if reuse else "0"], capture_output=True, text=True, check=True)
                runs[reuse].append(json.loads(out.stdout.strip().splitlines()[-1]))
                log(f"[{case} reuse={reuse}] " + " ".join(f"{t:.3f}" for t in runs[reuse][-1]["seconds"]))
        med = {r: statistics.median(t for run in runs[r] for t in run["seconds"][1:]) for r in runs}
        same = len({run["digest"] for r in runs for run in runs[r]}) == 1
        rows_out.append([name, runs[False][0]["n"], int(m), med[False], med[True], med[False] / med[True], same])
        notes.append(f"- {case}: fits 2-8 of each process, fresh stores: "
                     + " | ".join(" ".join(f"{t:.3f}" for t in run["seconds"][1:]) for run in runs[False])
                     + "; reused: " + " | ".join(" ".join(f"{t:.3f}" for t in run["seconds"][1:])
                                                 for run in runs[True]))
    body = (f"{args.processes} fresh processes per variant and case (alternating); eight fits each at the noises "
            f"{', '.join(map(str, NOISES))}; medians over fits 2-8 of all processes.\n\n"
            + markdown_table(["dataset", "rows", "M", "fit s, fresh stores", "fit s, reuse_stores()", "speed-up",
                              "same coefficients"], rows_out)
            + "\n\n" + "\n".join(notes) + "\n")
    path = write_result(args.out, "A penalty sweep's fits with and without store reuse", environment_lines(), body)
    log(f"written {path}")


if __name__ == "__main__":
    main()
