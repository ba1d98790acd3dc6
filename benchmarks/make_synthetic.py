"""Write a synthetic regression set as a ``.npz`` that ``compare.py`` / ``auto_ab.py`` load by name (``X``, ``y``;
no split arrays, so the loader splits 80/20 at random, seed 0).

``x ~ N(0, I_d)`` (float32), ``y = sin(z_1) + 0.5 cos(z_2) z_3 + 0.1 eps`` with ``z = x W``, ``W ~ N(0, 1/d)``
(``d x 3``), ``eps ~ N(0, 1)``: a smooth function of a 3-dimensional projection with 10 % noise, the same
form as ``fit.py``'s reference problem, with its own generator. Used for ``auto_fit`` checks on more rows than
the real sets of ``../shared/data`` have (only flights has more than ``select_rows``):

    .venv/bin/python benchmarks/make_synthetic.py --out /tmp/data/synth1m.npz          # 1.25M x 20
    ln -s $PWD/../shared/data/flights.npz /tmp/data/
    GPFALKON_DATA=/tmp/data .venv/bin/python benchmarks/auto_ab.py --before A --after B \\
        --runs flights:25 synth1m:25 flights:40 synth1m:40 --seed 0 --out ...
"""
from __future__ import annotations

import argparse
import math
import pathlib

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .npz to write (its name without .npz is the dataset's name)")
    p.add_argument("--rows", type=int, default=1_250_000)
    p.add_argument("--d", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    if args.rows < 10 or args.d < 3:
        p.error("--rows must be >= 10 and --d >= 3")
    rng = np.random.default_rng(args.seed)
    w = rng.standard_normal((args.d, 3)) / math.sqrt(args.d)
    x = rng.standard_normal((args.rows, args.d)).astype(np.float32)
    z = x.astype(np.float64) @ w
    y = np.sin(z[:, 0]) + 0.5 * np.cos(z[:, 1]) * z[:, 2] + 0.1 * rng.standard_normal(args.rows)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, X=x, y=y.astype(np.float32))
    print(f"wrote {out} ({args.rows:,} x {args.d})")


if __name__ == "__main__":
    main()
