"""Passes over a row source (data larger than memory) in construction and fits, and their seconds.

Every pass over a file-backed :class:`~gpfalkon.backend.sources.NpyRows` reads all ``n d`` values from disk (or
the page cache); besides its ``K_Mn`` products, a fit used to re-scan the rows for NaN or Inf (construction, the
center draw, every operator build) and for the fit tracker's fingerprint (two scans a fit). This script writes
float32 rows to a ``.npy`` file, counts the rows each phase reads (``NpyRows._read`` wrapped) and times it:
construction, a first fit, a refit, a second model on the same source. ``K_nM`` is not stored
(``store_kernel=False``, as on data larger than memory) and CG runs ``--iters`` iterations.

    .venv/bin/python benchmarks/source_passes.py [--rows 4000000] [--d 9] [--centers 500] [--iters 10]

Run it from another tree (``PYTHONPATH=<tree>``) for the before/after table.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import gpytorch
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon
from gpfalkon import FalkonGP, FalkonOptions
from gpfalkon.backend.sources import NpyRows

from _common import REPO, environment_lines, log, markdown_table, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--d", type=int, default=9)
    ap.add_argument("--centers", type=int, default=500)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "source-passes.md")
    args = ap.parse_args()
    env = environment_lines()
    n, d = args.rows, args.d
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "x.npy"
        x = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
        for s in range(0, n, 1_000_000):
            x[s:s + 1_000_000] = rng.uniform(-2, 2, size=(min(1_000_000, n - s), d))
        y = torch.from_numpy(np.sin(x[:, 0]) + 0.5 * np.cos(2 * x[:, 1]) + 0.1 * rng.standard_normal(n)).float()
        x.flush()
        del x
        counted = [0]
        original = NpyRows._read

        def counting(self, start, stop):
            counted[0] += stop - start
            return original(self, start, stop)

        NpyRows._read = counting  # type: ignore[method-assign]
        rows = []

        def phase(name, fn):
            counted[0] = 0
            t0 = time.perf_counter()
            out = fn()
            rows.append([name, counted[0] / n, time.perf_counter() - t0])
            log(f"{name}: {counted[0] / n:.2f} passes, {rows[-1][2]:.2f} s")
            return out

        src = NpyRows([path])
        kw = dict(num_centers=args.centers, penalty=1e-6, seed=0, store_kernel=False, tol=0.0, max_iter=args.iters,
                  options=FalkonOptions(solve_method="cg"))

        def kernel():
            k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())
            k.base_kernel.lengthscale = 1.0
            return k

        model = phase("construction", lambda: FalkonGP(src, y, kernel(), **kw))
        phase(f"first fit ({args.iters} CG iterations)", model.fit)
        phase("refit", model.fit)
        other = phase("second model on the source: construction", lambda: FalkonGP(src, y, kernel(), **kw))
        phase("second model: fit", other.fit)
        NpyRows._read = original  # type: ignore[method-assign]
    table = markdown_table(["phase", "passes over the rows", "seconds"], rows, align="lrr")
    body = (f"gpfalkon {gpfalkon.__version__} from `{pathlib.Path(gpfalkon.__file__).parent.parent}`; "
            f"{n:,} float32 rows x {d} features in one `.npy` file (`NpyRows`, in the page cache after it was "
            f"written), M = {args.centers}, K_nM not stored, CG for {args.iters} iterations (each one pass; the "
            "right-hand side another). 'passes over the rows' = rows read / n.\n\n" + table + "\n")
    write_result(args.out, "Passes over a row source", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
