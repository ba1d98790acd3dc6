"""Where BoTorchSearch's own time goes (surrogate fits vs acquisition optimisation), and what
warm-starting the surrogate's hyperparameters saves, on an objective that costs nothing.

Space: the one of ``benchmarks/tuning.py`` (num_centers Integer(200, 5000, log), 4 kernels,
penalty and lengthscale factor LogFloat); objective: a closed-form bowl (optimum 0 at
num_centers 2000, matern32, penalty 1e-6, factor 0.7). 25 evaluations (8 random, 17 BoTorch
steps) per run, seeds 0-2, ``warm_start`` False and True in the same run, one after the other.

    .venv/bin/python benchmarks/tuning_overhead.py
"""
from __future__ import annotations

import math
import pathlib
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tuning import SPACE

from gpfalkon.tuning import BoTorchSearch

from _common import REPO, environment_lines, log, markdown_table, write_result


def bowl(c: dict) -> float:
    return ((math.log10(c["penalty"]) + 6) ** 2 / 9 + math.log(c["num_centers"] / 2000) ** 2 / 4
            + math.log(c["lengthscale_factor"] / 0.7) ** 2 + (0.0 if c["kernel"] == "matern32" else 0.5))


def main() -> None:
    warnings.simplefilter("ignore")
    env = environment_lines()
    rows, walls = [], {False: [], True: []}
    for seed in (0, 1, 2):
        for warm in (False, True):
            t0 = time.perf_counter()
            s = BoTorchSearch(SPACE, bowl, 25, seed=seed, warm_start=warm)
            res = s.run()
            wall = time.perf_counter() - t0
            walls[warm].append(wall)
            rows.append([seed, "yes" if warm else "no", wall, s.timings["fit_gp"], s.timings["optimize_acqf"],
                         res.best_value])
            log(f"seed {seed} warm_start {warm}: {wall:.1f} s, best {res.best_value:.4f}")
    table = markdown_table(["seed", "warm start", "wall s", "surrogate fits s", "acquisition opt. s", "best value"],
                           rows, align="lcrrrr")
    ratio = sum(walls[True]) / sum(walls[False])
    body = (f"{table}\n\nTotal wall time with warm start / without: {ratio:.2f}. Per BoTorch step "
            f"(17 per run): {sum(walls[False]) / 51:.2f} s without, {sum(walls[True]) / 51:.2f} s with.\n")
    write_result(REPO / "benchmarks" / "results" / "tuning-overhead.md",
                 "BoTorchSearch overhead: surrogate fits vs acquisition optimisation", env, body)


if __name__ == "__main__":
    main()
