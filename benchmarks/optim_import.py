"""The first ``torch.optim.Adam`` of a process against ``gpfalkon._optim.Adam`` (why the latter exists).

``torch.optim``'s optimizers import ``torch._dynamo`` the first time one is built; ``auto_fit`` runs its
learning stage against a wall-clock budget, so that import would come out of the budget of every first call
in a process. Each row: a fresh interpreter (``--processes`` of them per variant, alternating) imports
``torch`` and ``gpfalkon``, then times building one optimizer over a 3-vector and its first step; it also
reports whether ``torch._dynamo`` was imported by then.

    .venv/bin/python benchmarks/optim_import.py --out benchmarks/results/auto-optim-import.md
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

CHILD = r"""
import json, sys, time
import torch, gpfalkon
from gpfalkon._optim import Adam
p = torch.nn.Parameter(torch.randn(3))
t0 = time.perf_counter()
opt = torch.optim.Adam([p], lr=0.1) if sys.argv[1] == "torch" else Adam([p], lr=0.1)
t1 = time.perf_counter()
p.square().sum().backward()
opt.step()
t2 = time.perf_counter()
print(json.dumps(dict(build=t1 - t0, step=t2 - t1, dynamo="torch._dynamo" in sys.modules)))
"""

VARIANTS = {"torch": "torch.optim.Adam", "gpfalkon": "gpfalkon._optim.Adam"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results/auto-optim-import.md"))
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.processes):
        for v in (VARIANTS if i % 2 == 0 else reversed(list(VARIANTS))):
            out = subprocess.run([sys.executable, "-c", CHILD, v], capture_output=True, text=True, check=True)
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            log(f"[{v}] {runs[v][-1]}")
    rows = [[VARIANTS[v], statistics.median(r["build"] for r in rs), statistics.median(r["step"] for r in rs),
             all(r["dynamo"] for r in rs), any(r["dynamo"] for r in rs)] for v, rs in runs.items()]
    body = (f"{args.processes} fresh processes per variant (alternating); medians of the seconds.\n\n"
            + markdown_table(["optimizer", "build s", "first step s", "torch._dynamo imported (all)",
                              "(any)"], rows)
            + "\n\nEach process's build s: "
            + "; ".join(f"{VARIANTS[v]}: " + ", ".join(f"{r['build']:.3f}" for r in rs) for v, rs in runs.items())
            + "\n")
    path = write_result(args.out, "The first Adam of a process: torch.optim against gpfalkon._optim",
                        environment_lines(), body)
    log(f"written {path}")


if __name__ == "__main__":
    main()
