"""benchmarks/compare.py as a user runs it on their own data (issue 16): input formats, the budget,
where files go."""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import make_data

ROOT = pathlib.Path(__file__).resolve().parents[1]

def test_compare_runs_on_a_users_csv_within_its_budget_and_writes_only_under_out(tmp_path):
    """benchmarks/compare.py --data (issue 16): a user's .csv, named target column, every method within the
    budget, nothing written outside --out's folder; a wrong column is named."""
    root = ROOT
    x, y = make_data(400, 3)
    csv = tmp_path / "mine.csv"
    lines = ["a,b,c,price"] + [",".join(f"{v:.6f}" for v in (*row.tolist(), t))
                               for row, t in zip(x, y.tolist(), strict=True)]
    csv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out" / "cmp.md"
    results = root / "benchmarks" / "results"
    before = set(results.glob(".compare-*"))  # where the old code wrote its scratch files
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(root / "benchmarks" / "compare.py"), "--data", str(csv), "--target", "price",
           "--methods", "falkon", "falkon-learned", "sgpr", "rff", "--budget", "6", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert {r["key"] for r in rows} == {"falkon", "falkon-learned", "sgpr", "rff"}
    learned = [r for r in rows if r["key"] == "falkon-learned"]
    assert [p[0] for p in learned[1]["curve"]] == [learned[0]["fit_s"], learned[1]["fit_s"]]
    assert learned[1]["curve"][1][1] == pytest.approx(learned[1]["error"])
    for r in rows:
        assert "error" in r and 0 < r["error"] < 1.0, r
        assert r["fit_s"] < 6 * 2 + 5, r  # hyperparameter selection included
        assert r["n_train"] == 320 and r["dataset"] == "mine"
    assert sorted(p.name for p in out.parent.iterdir()) in (["cmp.jsonl", "cmp.md"], ["cmp.jsonl", "cmp.md", "cmp.png"])
    assert set(results.glob(".compare-*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.csv", "out"]
    bad = subprocess.run([*cmd[:5], "cost", *cmd[6:]], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "--target 'cost' is not a column" in bad.stderr


def _compare_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import compare

    return compare


def test_hold_out_selection_stops_at_its_deadline(monkeypatch, tmp_path):
    """FALKON's hold-out selection in compare.py starts no new fit after its deadline (it ran 106 s under
    --budget 15): with a deadline in the past, one fit per grid, the first grid values."""
    import gpytorch
    import torch

    compare = _compare_module(monkeypatch)
    monkeypatch.setitem(compare.WORK, "dir", tmp_path)
    x, y = make_data(300, 2, dtype=torch.float32)
    data = dict(name="tiny", xtr=x, ytr=y)
    fits = []
    real = compare.select_noise

    def counting(*args, **kwargs):
        fits.append(kwargs.get("deadline"))
        return real(*args, **kwargs)

    import gpfalkon

    n_fits = []
    real_fit = gpfalkon.FalkonGP.fit

    def counting_fit(self, *args, **kwargs):
        n_fits.append(1)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(gpfalkon.FalkonGP, "fit", counting_fit)
    real(data, lambda: gpytorch.kernels.RBFKernel(), 50, deadline=0.0)
    assert len(n_fits) == 1  # the first grid point only
    real(data, lambda: gpytorch.kernels.RBFKernel(), 50)
    assert len(n_fits) == 1 + len(compare.NOISE_GRID)
    monkeypatch.setattr(compare, "select_noise", counting)
    hyp = compare.heuristic_hypers(data, deadline=0.0)
    assert len(fits) == 1 and hyp["complete"] is False and hyp["multiplier"] == compare.LS_MULTIPLIERS[0]
    assert (tmp_path / ".compare-hyper-tiny.json").exists()


@pytest.mark.parametrize("suffix", [".npz", ".parquet"])
def test_user_data_formats_read_the_same_arrays(monkeypatch, tmp_path, suffix):
    import numpy as np

    compare = _compare_module(monkeypatch)
    x, y = make_data(50, 3)
    X, Y = x.numpy(), y.numpy()
    path = tmp_path / f"d{suffix}"
    if suffix == ".npz":
        np.savez(path, X=X, y=Y)
        target = None
    else:
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.table({"u": X[:, 0], "v": X[:, 1], "w": X[:, 2], "t": Y}), path)
        target = "t"
    Xr, Yr, names = compare._read_table(path, target, None)
    np.testing.assert_array_equal(Xr, X)
    np.testing.assert_array_equal(Yr, Y)
    if suffix == ".parquet":
        assert names == ["u", "v", "w"]
        Xs, _, _ = compare._read_table(path, "t", ["w", "u"])
        np.testing.assert_array_equal(Xs, X[:, [2, 0]])
        with pytest.raises(SystemExit, match=r"--features: \['z'\] are not columns"):
            compare._read_table(path, "t", ["z"])


def test_nlpd_is_gpytorchs_in_the_targets_units(monkeypatch):
    """compare.py's NLPD (standardised scores and variances, reported in the target's units) equals GPyTorch's
    ``negative_log_predictive_density`` of the same Gaussian in raw units; on a subset of rows, of those rows."""
    import gpytorch
    import numpy as np
    import torch

    compare = _compare_module(monkeypatch)
    g = torch.Generator().manual_seed(0)
    y_std = torch.randn(50, generator=g, dtype=torch.float64)
    mu = y_std + 0.3 * torch.randn(50, generator=g, dtype=torch.float64)
    var = 0.05 + torch.rand(50, generator=g, dtype=torch.float64)
    scale, shift = 3.0, 10.0
    data = dict(yte=y_std, y_scale=scale)
    raw = gpytorch.distributions.MultivariateNormal(mu * scale + shift, torch.diag(var * scale**2))
    want = float(gpytorch.metrics.negative_log_predictive_density(raw, y_std * scale + shift))
    assert compare.nlpd(data, mu, var) == pytest.approx(want, rel=1e-12)
    idx = np.array([1, 4, 9])
    sub = gpytorch.distributions.MultivariateNormal(mu[idx] * scale, torch.diag(var[idx] * scale**2))
    want_sub = float(gpytorch.metrics.negative_log_predictive_density(sub, y_std[idx] * scale))
    assert compare.nlpd(data, mu, var[idx], idx) == pytest.approx(want_sub, rel=1e-12)
    assert math.isnan(compare.nlpd(data, mu, torch.zeros(50, dtype=torch.float64)))


def _row(key: str, error: float, fit_s: float, curve=None) -> dict:
    return dict(key=key, method=key, error=error, fit_s=fit_s, curve=curve or [])


def test_the_10x_table_picks_no_run_by_its_test_error(monkeypatch):
    """Issue 17's ratio: the primary fraction's run is reported whatever the other runs did (a faster run that
    happens to reach the error is not picked); the monotone rule counts a run only when every larger-budget run
    reached the error too; int16 runs are not in either."""
    compare = _compare_module(monkeypatch)
    base = _row("sgpr", 0.100, 120.0, curve=[[10.0, 0.2, 1], [60.0, 0.1, 2], [120.0, 0.1, 3]])
    runs = [_row("falkon-auto-8", 0.09, 15.0), _row("falkon-auto-10", 0.11, 12.0),
            _row("falkon-auto-12", 0.095, 10.0), _row("falkon-auto-24", 0.08, 5.0),
            _row("falkon-auto16-32", 0.05, 1.0)]
    row = compare.time_to_baseline("set", [base, *runs], primary=12)
    assert row[3] == 60.0  # first reached its final curve error at 60 s
    assert row[4:9] == ["/12", 0.095, 10.0, 6.0, "no (time)"]
    assert row[9:12] == ["/8", 15.0, 4.0]  # /10 missed: /12 and /24 do not count
    assert row[13:] == ["-", None, None, None, "-"]  # no baseline-relative run
    row = compare.time_to_baseline("set", [base, *runs], primary=10)
    assert row[4] == "/10" and row[8].startswith("no (error 10.00 % higher")
    assert "/24 Y" in row[12] and "auto16" not in row[12]
    # the baseline-relative run (budget 60 / 12 = 5 s): met at 5.5 s and the baseline's error; its rows are in
    # neither the primary nor the monotone rule
    rel = _row("falkon-auto-rel-12", 0.1, 5.5)
    row = compare.time_to_baseline("set", [base, *runs, rel], primary=12)
    assert row[4:12] == ["/12", 0.095, 10.0, 6.0, "no (time)", "/8", 15.0, 4.0] and "rel" not in row[12]
    assert row[13:] == ["5 s (/12)", 0.1, 5.5, pytest.approx(60 / 5.5), "yes"]
    row = compare.time_to_baseline("set", [base, *runs, dict(rel, error=0.1005)], primary=12)
    assert row[17] == "no (error 0.50 % higher)"
    row = compare.time_to_baseline("set", [base, *runs, dict(rel, fit_s=6.5)], primary=12)
    assert row[17] == "no (time)"


def test_a_baseline_relative_budget_is_the_better_baselines_time_over_k(monkeypatch):
    """``falkon-auto-rel-12``'s budget: the lower-error baseline's time to its own error / 12, from the set's
    finished runs only (a failed run, another method, no baseline: not used)."""
    compare = _compare_module(monkeypatch)
    sgpr = _row("sgpr", 0.100, 120.0, curve=[[10.0, 0.2, 1], [60.0, 0.1, 2], [120.0, 0.1, 3]])
    svgp = _row("svgp", 0.120, 120.0, curve=[[30.0, 0.12, 1], [120.0, 0.12, 2]])
    assert compare.relative_budget([sgpr, svgp], 12) == pytest.approx(5.0)
    assert compare.relative_budget([dict(sgpr, error=0.13), svgp], 12) == pytest.approx(2.5)
    assert compare.relative_budget([dict(key="sgpr", method="sgpr", failed="x"), svgp], 10) == pytest.approx(3.0)
    assert compare.relative_budget([_row("falkon-auto-12", 0.05, 9.0)], 12) is None


def test_a_baseline_relative_run_needs_a_baseline_before_it(monkeypatch, capsys):
    """``--methods falkon-auto-rel-12 sgpr`` is refused, naming the argument: its budget comes from the baseline."""
    compare = _compare_module(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["compare.py", "--datasets", "wine", "--methods", "falkon-auto-rel-12", "sgpr"])
    with pytest.raises(SystemExit):
        compare.main()
    assert "--methods: falkon-auto-rel-12" in capsys.readouterr().err


def test_a_baseline_is_reached_on_its_own_curve_scale(monkeypatch):
    """flights' curve is scored on a subset of the test rows, its final error on all of them: the time a
    baseline reached its error is read against its own last curve point, not the whole-test error."""
    compare = _compare_module(monkeypatch)
    base = _row("svgp", 0.950, 400.0, curve=[[100.0, 0.99, 1], [330.0, 0.968, 2], [400.0, 0.968, 3]])
    assert compare.baseline_reached(base) == 330.0
    assert compare.baseline_reached(_row("svgp", 0.95, 77.0)) == 77.0
    assert compare.curve_on_subset(dict(base, n_test=1_000_000))
    assert not compare.curve_on_subset(dict(base, n_test=5_000))


def test_a_warm_process_imports_nothing_at_a_gpytorch_kernels_first_call():
    """compare.py's workers pay a process's one-time imports before a method's clock starts: after
    ``warm_process``, a GPyTorch kernel's first evaluation (and its ``batch_shape``) imports no further module.
    Without it the first call imports SymPy (``torch.broadcast_shapes``); the check without the warm-up says so."""
    code = (
        "import sys; sys.path.insert(0, {bench!r})\n"
        "import torch, gpytorch, compare\n"
        "if {warm}: compare.warm_process()\n"
        "before = set(sys.modules)\n"
        "k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=3))\n"
        "x = torch.randn(20, 3)\n"
        "k(x, x[:5]).to_dense(); k.batch_shape\n"
        "print(sorted(n for n in set(sys.modules) - before if not n.startswith('gpytorch')))\n")
    got = {}
    for warm in (True, False):
        proc = subprocess.run([sys.executable, "-c", code.format(bench=str(ROOT / "benchmarks"), warm=warm)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        got[warm] = proc.stdout.strip().splitlines()[-1]
    assert got[True] == "[]"
    assert "sympy" in got[False]


def test_a_loss_that_jumps_about_is_not_converged(monkeypatch):
    compare = _compare_module(monkeypatch)
    flat = [1.0 - 1e-3 * i for i in range(10)] + [0.99] * 60
    assert compare._converged(flat, 50, 1e-5)
    jumpy = [1.0 - 1e-3 * i for i in range(10)] + [0.99 + 0.02 * (i % 2) for i in range(60)]
    assert not compare._converged(jumpy, 50, 1e-5)
    assert not compare._converged(flat[:50], 50, 1e-5)


def test_round_summary_reads_compares_10x_table(monkeypatch, tmp_path):
    """benchmarks/round_summary.py reads the time-to-error table as compare.py writes it (the same rows, the same
    markdown): the primary run's speed-up and verdict, the monotone run, per round and dataset, and counts the
    rounds that met each rule."""
    compare = _compare_module(monkeypatch)
    import round_summary

    base = _row("sgpr", 0.100, 120.0, curve=[[10.0, 0.2, 1], [60.0, 0.1, 2], [120.0, 0.1, 3]])
    met = [_row("falkon-auto-12", 0.095, 5.0), _row("falkon-auto-24", 0.09, 2.0)]
    short = [_row("falkon-auto-12", 0.095, 10.0), _row("falkon-auto-24", 0.08, 5.0)]
    above = [_row("falkon-auto-12", 0.104, 5.0), _row("falkon-auto-24", 0.09, 2.0)]

    def round_file(name: str, sets: dict[str, list[dict]], baseline: dict = base) -> pathlib.Path:
        rows = [compare.time_to_baseline(ds, [baseline, *runs], primary=12) for ds, runs in sets.items()]
        text = "\n".join(["# title", "", round_summary.SECTION + " (issue 17: 10x)", "", "legend (a, b)", "",
                          compare.markdown_table(compare.SPEED_HEADERS, rows, align=compare.SPEED_ALIGN), "",
                          "Datasets: " + "; ".join(f"{ds} (treforevans split 3, n_train 100, n_test 10, d 2)"
                                                   for ds in sets) + "."])
        path = tmp_path / name
        path.write_text(text)
        return path

    first = round_file("auto-r7-partial.md", {"a": met, "b": short})
    second = round_file("auto-r7-rest.md", {"c": above})
    third = round_file("auto-r8.md", {"a": short, "c": met})
    parsed = round_summary.parse_round(first.read_text())
    assert parsed["a"]["speed"] == pytest.approx(12.0) and parsed["a"]["verdict"] == "yes"
    assert parsed["b"]["verdict"] == "no (time)" and parsed["b"]["monotone"] == "/24"
    assert parsed["b"]["mono_speed"] == pytest.approx(12.0) and parsed["b"]["split"] == "treforevans split 3"
    rounds = round_summary.collect([first, second, third])
    assert list(rounds) == [7, 8] and sorted(rounds[7]) == ["a", "b", "c"]
    assert round_summary.primary_cell(rounds[7]["a"]) == "12.0 Y"
    assert round_summary.primary_cell(rounds[7]["b"]) == "6.0 t"
    assert round_summary.primary_cell(rounds[7]["c"]) == "e +4.0%"
    assert round_summary.monotone_cell(rounds[7]["c"]) == "-"  # /12 missed it, so /24 does not count
    # the excess is the verdict's, from the unrounded errors: 0.9501 / 0.9476 is +0.26 %, the table's 0.950 / 0.948
    # would say +0.2 %
    close = round_file("auto-r9.md", {"d": [_row("falkon-auto-12", 0.9501, 5.0)]},
                       baseline=_row("sgpr", 0.9476, 120.0, curve=[[60.0, 0.9476, 1], [120.0, 0.9476, 2]]))
    assert round_summary.primary_cell(round_summary.parse_round(close.read_text())["d"]) == "e +0.3%"
    assert round_summary.monotone_cell(rounds[8]["a"]) == "12.0 /24 Y"
    primary, monotone = round_summary.summary(rounds).split("## Monotone rule")

    def squeeze(text: str) -> str:
        return re.sub(r" +", " ", text)

    assert "| a | 12.0 Y | 6.0 t | 1 of 2 |" in squeeze(primary)
    assert "| rounds met | 1 of 3 | 1 of 2 |" in squeeze(primary)
    assert "| b | 12.0 /24 Y | | 1 of 1 |" in squeeze(monotone)
    assert "Baseline-relative" not in monotone  # no round ran it
    # a round with baseline-relative runs: its own table, of those rounds and sets only
    fourth = round_file("auto-r10.md", {"a": [*short, _row("falkon-auto-rel-12", 0.099, 5.0)],
                                        "b": [*met, _row("falkon-auto-rel-12", 0.105, 4.0)], "c": short})
    rounds = round_summary.collect([first, second, third, fourth])
    assert rounds[10]["a"]["rel"]["verdict"] == "yes" and "rel" not in rounds[10]["c"]
    rel = squeeze(round_summary.summary(rounds).split("## Baseline-relative rule")[1].split("## Splits")[0])
    assert "| r10 | met |" in rel and "| a | 12.0 Y | 1 of 1 |" in rel and "| b | e +5.0% | 0 of 1 |" in rel
    assert "| c |" not in rel and "| rounds met | 1 of 2 | |" in rel
    assert "| rounds met | 2 of 3 | 2 of 2 |" in squeeze(monotone.split("## Splits")[0])
    # two files of one round scoring one set (a baseline added where the first failed): the row against the better
    # baseline is kept, whichever file came first
    failed = round_file("auto-r11-a.md", {"e": short}, baseline=_row("sgpr", 4.5, 120.0,
                                                                     curve=[[10.0, 4.5, 1], [120.0, 4.5, 2]]))
    valid = round_file("auto-r11-b.md", {"e": met})
    for order in ([failed, valid], [valid, failed]):
        row = round_summary.collect(order)[11]["e"]
        assert row["base_error"] == pytest.approx(0.1) and round_summary.primary_cell(row) == "12.0 Y"
