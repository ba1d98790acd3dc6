"""Issue 15's reproducers, each run and classified: clear error / correct result / obscure /
silent wrong / hang.

Every case is one of the issue's reproducers (n = 400, d = 3, float64 unless said), written
against the public API only, so the same script classifies an older checkout
(``PYTHONPATH=<old checkout> python benchmarks/reliability.py``) for the before / after table.

* **clear error**: for invalid input, an exception of a gpfalkon / ValueError / TypeError type, or a
  warning, whose message names the argument or the cause (each case's ``expect`` pattern);
* **correct result**: the call returns, and the case's check of the result passes;
* **obscure**: any other exception, a message that names neither, or an exception for valid input;
* **silent wrong**: the call returns a wrong result without a warning naming the cause;
* **hang**: no answer within 120 s.

    .venv/bin/python benchmarks/reliability.py [--out benchmarks/results/reliability.md]
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from collections import Counter
from collections.abc import Callable

import gpytorch
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpfalkon
from gpfalkon import FalkonClassifier, FalkonGP

from _common import REPO, environment_lines, log, markdown_table, write_result

NAMES = ("train_x", "train_y", "x must", "x contains", "penalty", "num_centers", "centers", "kernel", "callback",
         "seed", "outcome_transform", "model", "low", "high", "choices", "history_path", "lr", "classes", "labels",
         "dtype", "float64", "NaN", "overflow", "ard_num_dims", "not finite", "non-finite", "alpha", "ill-conditioned")


def data(n=400, d=3, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * x[:, 0]) + 0.5 * x[:, 1] + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def rbf(dtype=torch.float64, ls=0.5):
    k = gpytorch.kernels.RBFKernel().to(dtype)
    k.lengthscale = ls
    return k


def model(dtype=torch.float64, **kw):
    x, y = data(dtype=dtype)
    kw.setdefault("kernel", rbf(dtype))
    kw.setdefault("num_centers", 50)
    kw.setdefault("penalty", 1e-4)
    return FalkonGP(x, y, **kw)


def predict(m, x):
    m.eval()
    with torch.no_grad():
        return m(x).mean


# ------------------------------------------------------------------ cases: (name, kind, fn, check)
# kind "bad": invalid input, a named error or warning is right; "valid": a correct result is right.
CASES: list[tuple[str, str, Callable[[], object], Callable[[object, list], bool] | None, str | None]] = []


def case(name: str, kind: str, check: Callable[[object, list], bool] | None = None, expect: str | None = None):
    """``expect``: a regular expression the error or warning must match to count as clear (it names
    the argument or the cause the issue asks for)."""
    def deco(fn):
        CASES.append((name, kind, fn, check, expect))
        return fn
    return deco


@case("ARD kernel with 5 dims on 3-d data", "bad", expect=r"ard_num_dims")
def _():
    x, y = data()
    return FalkonGP(x, y, kernel=gpytorch.kernels.RBFKernel(ard_num_dims=5).double(), num_centers=20).fit()


@case("empty test batch", "valid", lambda r, w: tuple(r.shape) == (0,))
def _():
    return predict(model().fit(), torch.empty(0, 3, dtype=torch.float64))


@case("numpy test inputs", "bad", expect=r"torch\.Tensor")
def _():
    return predict(model().fit(), np.zeros((5, 3)))


@case("penalty=1e-300 (valid)", "valid", lambda r, w: bool(torch.isfinite(r).all()))
def _():
    return predict(model(penalty=1e-300, max_iter=20).fit(), data()[0][:5])


@case("penalty=-1e-3 printed exactly", "bad", None, expect=r"-0\.001\b")
def _():
    try:
        model(penalty=-1e-3)
    except ValueError as exc:
        if "-0.001" not in str(exc) or "0000000" in str(exc):
            raise RuntimeError(f"unclear value in: {exc}") from None
        raise


@case("float32 data scaled by 1e30", "bad", expect=r"overflow")
def _():
    x, y = data(dtype=torch.float32)
    return predict(FalkonGP(x * 1e30, y, kernel=rbf(torch.float32), num_centers=50, penalty=1e-4).fit(), x[:5])


@case("float32 lengthscale 1e-30", "bad", expect=r"overflow|lengthscale")
def _():
    m = model(torch.float32, kernel=rbf(torch.float32, ls=1e-30)).fit()
    r = predict(m, data(dtype=torch.float32)[0][:5])
    if not bool(torch.isfinite(r).all()):
        raise RuntimeError("NaN predictions")
    return r


@case("train_y[3] = nan in place, then fit", "bad", expect=r"train_y")
def _():
    m = model()
    m.train_targets[3] = float("nan")
    return m.fit()


@case("fit(callback=42)", "bad", expect=r"callback")
def _():
    return model().fit(callback=42)


@case("seed='abc'", "bad", expect=r"seed")
def _():
    return model(seed="abc")


@case("FalkonModel(outcome_transform='bogus')", "bad", expect=r"outcome_transform")
def _():
    from gpfalkon.botorch import FalkonModel

    x, y = data()
    return FalkonModel(x, y.unsqueeze(-1), outcome_transform="bogus")


@case("NystromCompReg('x')()", "bad", expect=r"model")
def _():
    from gpfalkon.objectives import NystromCompReg

    return NystromCompReg("x")()


@case("tuning.Float('a', 'b')", "bad", expect=r"low")
def _():
    from gpfalkon.tuning import Float

    return Float("a", "b")


@case("tuning.Categorical([[1], [2]])", "bad", expect=r"hashable|choices")
def _():
    from gpfalkon.tuning import Categorical

    return Categorical([[1], [2]])


@case("BoTorchSearch whose objective returns NaN", "bad", expect=r"non-finite")
def _():
    from gpfalkon.tuning import BoTorchSearch, LogFloat

    return BoTorchSearch({"p": LogFloat(1e-6, 1.0)}, lambda c: float("nan"), budget=4, n_initial=2,
                         num_restarts=2, raw_samples=16).run()


@case("corrupt history_path", "bad", expect=r"history_path")
def _():
    from gpfalkon.tuning import LogFloat, RandomSearch

    with tempfile.TemporaryDirectory() as d:
        p = pathlib.Path(d) / "h.json"
        p.write_text("{not json")
        return RandomSearch({"p": LogFloat(1e-6, 1.0)}, lambda c: 1.0, budget=2, history_path=p).run()


@case("GCV with a NaN noise", "bad", expect=r"penalty|noise")
def _():
    from gpfalkon.objectives import GCV

    m = model()
    with torch.no_grad():
        m.likelihood.raw_noise.fill_(float("nan"))
    return GCV(m)()


@case("minimize(5, lr=1e6)", "bad", lambda r, w: all(map(math.isfinite, r)), expect=r"lr=")
def _():
    from gpfalkon.objectives import GCV

    m = model()
    vals = GCV(m).minimize(5, lr=1e6)
    if not all(bool(torch.isfinite(p).all()) for p in m.parameters()):
        raise RuntimeError("parameters became NaN")
    return vals


@case("y.copy_(y.flip(0)) after fit, then predict", "bad", expect=r"changed since")
def _():
    m = model().fit()
    m.train_targets.copy_(m.train_targets.flip(0))
    return predict(m, data()[0][:5])


@case("two rows of x swapped after fit, then predict", "bad", expect=r"changed since")
def _():
    m = model().fit()
    x = m.train_inputs[0]
    x[[0, 1]] = x[[1, 0]]
    return predict(m, data()[0][:5])


@case("FalkonClassifier on continuous float labels", "bad", expect=r"labels|classes")
def _():
    x, y = data()
    return FalkonClassifier(x, y, rbf(), num_centers=20, penalty=1e-3)


@case("LOOCV after train_targets[0] = nan", "bad", expect=r"train_y")
def _():
    from gpfalkon.objectives import LOOCV

    m = model()
    m.train_targets[0] = float("nan")
    v = LOOCV(m)()
    if not bool(torch.isfinite(v)):
        raise AssertionError("silent NaN")  # classified below as silent wrong
    return v


@case("RandomSearch whose objective always fails", "bad", expect=r"non-finite")
def _():
    from gpfalkon.tuning import LogFloat, RandomSearch

    return RandomSearch({"p": LogFloat(1e-6, 1.0)}, lambda c: float("nan"), budget=3).run()


def _load(state, target):
    target.load_state_dict(state, strict=False)
    return target


@case("state fitted on permuted y loads", "bad", lambda r, w: not bool(r.fitted), expect=r"train_y")
def _():
    m = model().fit()
    x, y = data()
    return _load(m.state_dict(), FalkonGP(x, y.flip(0), kernel=rbf(), num_centers=50, penalty=1e-4))


@case("partial load without kernel keys, other lengthscale", "bad", lambda r, w: not bool(r.fitted),
      expect=r"kernel")
def _():
    m = model().fit()
    state = {k: v for k, v in m.state_dict().items() if not k.startswith("kernel.")}
    return _load(state, model(kernel=rbf(ls=16.25)))


@case("state with NaN alpha loads", "bad", lambda r, w: not bool(r.fitted), expect=r"NaN")
def _():
    m = model().fit()
    state = m.state_dict()
    state["alpha"][0] = float("nan")
    return _load(state, model())


@case("float64 state into a float32 model: message", "bad", lambda r, w: not bool(r.fitted), expect=r"dtype")
def _():
    m = model().fit()
    return _load(m.state_dict(), model(torch.float32, kernel=rbf(torch.float32)))


@case("settings in two threads", "valid", lambda r, w: r == [2, 7])
def _():
    out = [None, None]
    barrier = threading.Barrier(2, timeout=60)

    def run(i, cap):
        m = model(penalty=1e-8, tol=0.0)
        with gpfalkon.settings.max_cg_iterations(cap):
            barrier.wait()
            m.fit()
            barrier.wait()
        out[i] = m.fit_info.iterations

    ts = [threading.Thread(target=run, args=(0, 2)), threading.Thread(target=run, args=(1, 7))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return out


@case("classifier scores next to another thread's variances", "valid", lambda r, w: r)
def _():
    x, y = data()
    clf = FalkonClassifier(x, (y > 0).long(), rbf(), num_centers=50, penalty=1e-3).fit()
    m = model().fit()
    m.eval()
    with torch.no_grad():
        ref = m(x[:20]).variance.clone()
    stop, ok = threading.Event(), [True]

    def scores():
        while not stop.is_set():
            clf.decision_function(x[:50])

    t = threading.Thread(target=scores)
    t.start()
    try:
        for _ in range(60):
            with torch.no_grad():
                v = m(x[:20]).variance
            if not torch.allclose(v, ref, rtol=1e-6, atol=0):
                ok[0] = False
    finally:
        stop.set()
        t.join()
    return ok[0]


@case("float32, penalty 1e-6, default tolerance: no warning", "valid",
      lambda r, w: not any("CG" in str(x.message) for x in w))
def _():
    m = model(torch.float32, kernel=rbf(torch.float32), penalty=1e-6).fit()
    return predict(m, data(dtype=torch.float32)[0][:5])


@case("float32 RBF lengthscale 10, penalty 1e-6", "valid",
      lambda r, w: bool(torch.isfinite(r).all()) and not any("float64" in str(x.message) and "float32" not in
                                                              str(x.message) for x in w))
def _():
    m = model(torch.float32, kernel=rbf(torch.float32, ls=10.0), penalty=1e-6).fit()
    return predict(m, data(dtype=torch.float32)[0][:5])


@case("float32 near-duplicate rows (500 x 10, M=400, penalty 1e-4), 4 noise levels", "valid",
      lambda r, w: r == 4)
def _():
    fits = 0
    for eps in (1e-9, 1e-7, 1e-6, 1e-5):
        g = torch.Generator().manual_seed(0)
        base = torch.rand(50, 10, generator=g)
        x = base.repeat(10, 1) + eps * torch.randn(500, 10, generator=g)
        y = x.sum(-1)
        m = FalkonGP(x, y, kernel=rbf(torch.float32, ls=1.0), num_centers=400, penalty=1e-4).fit()
        if bool(torch.isfinite(predict(m, x[:5])).all()):
            fits += 1
    return fits


@case("float32 lengthscale 1e30: advice matches the cause", "valid",
      lambda r, w: bool(torch.isfinite(r).all()) and not any("raise max_iter" in str(x.message) for x in w))
def _():
    m = model(torch.float32, kernel=rbf(torch.float32, ls=1e30)).fit()
    return predict(m, data(dtype=torch.float32)[0][:5])


@case("memory_budget default follows the available memory", "valid", lambda r, w: r)
def _():
    from gpfalkon.backend import blocks

    return hasattr(blocks, "default_memory_budget") and blocks.memory_budget_for() == blocks.default_memory_budget()


class Hang(Exception):
    pass


def classify(kind, fn, check, expect) -> tuple[str, str]:
    def alarm(*_):
        raise Hang

    def names(msg: str) -> bool:
        return any(w in msg for w in NAMES) and (expect is None or re.search(expect, msg) is not None)

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(120)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except Hang:
            return "hang", ""
        except AssertionError as exc:
            return "silent wrong", str(exc)[:120]
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:160]
            ok_type = isinstance(exc, (ValueError, TypeError)) or type(exc).__module__.startswith("gpfalkon")
            if kind == "bad" and ok_type and names(str(exc)):
                return "clear error", msg
            # an unnamed or raw error; or valid input refused
            return "obscure", msg
        finally:
            signal.alarm(0)
    warned = [w for w in caught if issubclass(w.category, (RuntimeWarning, UserWarning)) and names(str(w.message))]
    other = [w for w in caught if issubclass(w.category, (RuntimeWarning, UserWarning)) and not names(str(w.message))]
    good = True if check is None else bool(check(result, caught))
    if kind == "valid":
        return ("correct result" if good else "silent wrong"), ""
    if warned and (check is None or good):
        return "clear error", str(warned[0].message)[:120]
    if check is not None and good:
        return ("obscure", str(other[0].message)[:120]) if other else ("correct result", "")
    return ("obscure", str(other[0].message)[:120]) if other else ("silent wrong", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--json", type=pathlib.Path, default=None, help="write the outcomes as JSON (for --compare)")
    ap.add_argument("--compare", type=pathlib.Path, default=None, help="JSON of a run of an older checkout")
    args = ap.parse_args()
    env = environment_lines()
    rows, outcomes = [], {}
    for name, kind, fn, check, expect in CASES:
        outcome, detail = classify(kind, fn, check, expect)
        outcomes[name] = outcome
        rows.append([name, outcome, detail])
        log(f"{outcome:15s} {name}  {detail[:100]}")
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1))
    if args.out:
        kinds = ["clear error", "correct result", "obscure", "silent wrong", "hang"]
        now = Counter(outcomes.values())
        count_rows = [["after (this checkout)", len(outcomes), *(now[k] for k in kinds)]]
        before = json.loads(args.compare.read_text()) if args.compare else None
        if before is not None:
            then = Counter(before.values())
            count_rows.insert(0, ["before", len(before), *(then[k] for k in kinds)])
            rows = [[r[0], before.get(r[0], "-"), r[1], r[2]] for r in rows]
            headers = ["case", "before", "after", "detail (after)"]
        else:
            headers = ["case", "outcome", "detail"]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=REPO).stdout.strip()
        body = (f"Checkout {commit}. Each case is one reproducer of issue 15; see the module docstring of "
                "`benchmarks/reliability.py` for the classification.\n\n"
                + markdown_table(["run", "cases", *kinds], count_rows) + "\n\n"
                + markdown_table(headers, rows) + "\n")
        write_result(args.out, "Reliability: issue 15's reproducers", env, body)
        log(f"written to {args.out}")


if __name__ == "__main__":
    main()
