"""Cost of the fit-validity digest against one FALKON data pass.

``FalkonGP`` recomputes the content digest of its training data (``gpfalkon.models.fit_state``)
at every fit and whenever the training tensors' identity changed; the issue asks for a cost
small next to one data pass. For float32 data ``n x d`` and ``M`` centers, this script times
``data_fingerprint(x, y)`` and one engine pass ``K_Mn (K_nM u)`` (what one CG iteration costs,
``K_nM`` not stored), median of 3. The digest is timed twice in the same run: with the C++ kernel of
``gpfalkon.backend.fused.word_digest`` (the library's CPU path) and with the torch definition it replaces
(``fused.set_enabled(False)``; the two give the same integers).

    .venv/bin/python benchmarks/fingerprint.py [--rows 200000 1000000] [--d 10] [--centers 1000]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpfalkon.backend import KernelEngine, fused
from gpfalkon.models.fit_state import data_fingerprint

from _common import REPO, environment_lines, log, markdown_table, median_time, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[200_000, 1_000_000])
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--centers", type=int, default=1000)
    ap.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "fingerprint.md")
    args = ap.parse_args()
    env = environment_lines()
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in args.rows:
        x = torch.randn(n, args.d, generator=g)
        y = torch.randn(n, generator=g)
        c = x[: args.centers].clone()
        k = gpytorch.kernels.RBFKernel()
        k.lengthscale = 3.0
        fused.set_enabled(False)
        t_torch, _ = median_time(lambda x=x, y=y: data_fingerprint(x, y))
        slow = data_fingerprint(x, y)[1]
        fused.set_enabled(None)
        t_fp, _ = median_time(lambda x=x, y=y: data_fingerprint(x, y))
        if not torch.equal(data_fingerprint(x, y)[1], slow):
            raise AssertionError("the C++ digest differs from the torch definition")
        eng = KernelEngine(k, x, c, store=False)
        u = torch.randn(args.centers, 1, dtype=torch.float64, generator=g)
        t_pass, _ = median_time(lambda eng=eng, u=u: eng.kmn_k(u))
        rows.append([n, args.d, args.centers, t_fp, t_torch, t_torch / t_fp, t_pass, t_fp / t_pass])
        log(f"n={n:,}: digest {t_fp:.4f} s (torch definition {t_torch:.4f} s), one pass {t_pass:.4f} s, "
            f"ratio {t_fp / t_pass:.3f}")
    table = markdown_table(["n", "d", "M", "digest s", "torch-definition digest s", "speed-up", "one data pass s",
                            "digest / pass"], rows, align="rrrrrrrr")
    body = ("float32 data, RBF kernel; the digest covers x and y (two 61-bit position-weighted sums over "
            "their 32-bit words, plus sums and norms; 'digest s' with the C++ kernel, 'torch-definition digest s' "
            "the same integers by torch's elementwise operations, `fused.set_enabled(False)`); the pass is "
            "`KernelEngine.kmn_k(u)` with `store=False` (K_nM recomputed block by block, as in every CG iteration "
            "of a large fit).\n\n"
            + table + "\n")
    write_result(args.out, "Fit-validity digest vs one data pass", env, body)
    log(f"written to {args.out}")


if __name__ == "__main__":
    main()
