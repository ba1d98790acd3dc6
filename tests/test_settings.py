"""Settings are per thread / context (issue 15, item 3); the automatic memory budget (item 5);
no code path toggles GPyTorch's process-wide flags."""
from __future__ import annotations

import threading

import gpytorch
import pytest
import torch

import gpfalkon
from gpfalkon import FalkonClassifier, FalkonGP, FalkonOptions, auto_fit, settings
from gpfalkon.backend import blocks

from conftest import make_data, make_kernel


def _model():
    x, y = make_data(200, 3)
    return FalkonGP(x, y, kernel=make_kernel("rbf", 3), num_centers=40, penalty=1e-7, tol=0.0,
                    options=FalkonOptions(solve_method="cg"))  # the settings under test are CG's


def test_settings_in_two_threads_do_not_leak():
    """Thread A fits under max_cg_iterations(2), thread B under (7), both inside their `with`
    blocks at the same time (a barrier holds them there): each fit runs its own cap."""
    barrier = threading.Barrier(2, timeout=60)
    out: dict[str, object] = {}

    def run(name: str, cap: int) -> None:
        try:
            m = _model()
            with settings.max_cg_iterations(cap), settings.cg_tolerance(0.0):
                barrier.wait()
                m.fit()
                barrier.wait()
                out[name] = (m.fit_info.iterations, settings.max_cg_iterations.value())
        except BaseException as exc:  # reported to the main thread
            out[name] = exc

    threads = [threading.Thread(target=run, args=("a", 2)), threading.Thread(target=run, args=("b", 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == {"a": (2, 2), "b": (7, 7)}, out
    # the main thread never saw either value
    assert settings.max_cg_iterations.value() == 100


def test_settings_nest_restore_and_validate():
    assert settings.block_rows.value() is None
    with settings.block_rows(64):
        with settings.block_rows(8):
            assert settings.block_rows.value() == 8
        assert settings.block_rows.value() == 64
    assert settings.block_rows.value() is None
    for cls, bad in ((settings.block_rows, 0), (settings.memory_budget, -5), (settings.max_cg_iterations, 2.5),
                     (settings.cg_tolerance, float("nan")), (settings.max_cg_iterations, True)):
        with pytest.raises(ValueError, match=cls.__name__):
            cls(bad)
    old = settings.max_cg_iterations.value()
    try:
        settings.max_cg_iterations.set_default(11)
        seen = []
        t = threading.Thread(target=lambda: seen.append(settings.max_cg_iterations.value()))
        t.start()
        t.join()
        assert seen == [11]  # a process-wide default reaches new threads
        assert settings.max_cg_iterations.overridden()
    finally:
        settings.max_cg_iterations.set_default(old)
    # the initial default set again is the default again (a float32 fit then takes float32's own tolerance)
    assert not settings.max_cg_iterations.overridden()
    tol = settings.cg_tolerance.value()
    try:
        settings.cg_tolerance.set_default(tol * 1000)
        assert settings.cg_tolerance.overridden()
    finally:
        settings.cg_tolerance.set_default(float(tol))
    assert not settings.cg_tolerance.overridden()
    with settings.cg_tolerance(tol):  # a with block is an explicit request, even of the default value
        assert settings.cg_tolerance.overridden()


def test_automatic_memory_budget(monkeypatch):
    monkeypatch.setattr(blocks, "available_memory", lambda device=None: 10 * 2**30)
    assert blocks.memory_budget_for() == 5 * 2**30
    monkeypatch.setattr(blocks, "available_memory", lambda device=None: 100 * 2**30)
    assert blocks.memory_budget_for() == blocks.AUTO_BUDGET_CAP
    monkeypatch.setattr(blocks, "available_memory", lambda device=None: 2**20)
    assert blocks.memory_budget_for() == blocks.AUTO_BUDGET_FLOOR
    monkeypatch.setattr(blocks, "available_memory", lambda device=None: None)
    assert blocks.memory_budget_for() == blocks.AUTO_BUDGET_FALLBACK
    with settings.memory_budget(12345):  # a setting or an argument wins
        assert blocks.memory_budget_for() == 12345
    assert blocks.memory_budget_for(777) == 777
    # a reserve (memory needed beside the kernel blocks) comes off the available memory, not off a given budget
    monkeypatch.setattr(blocks, "available_memory", lambda device=None: 10 * 2**30)
    assert blocks.memory_budget_for(reserve=4 * 2**30) == 3 * 2**30
    assert blocks.memory_budget_for(reserve=20 * 2**30) == blocks.AUTO_BUDGET_FLOOR
    assert blocks.memory_budget_for(777, reserve=4 * 2**30) == 777
    with settings.memory_budget(12345):
        assert blocks.memory_budget_for(reserve=4 * 2**30) == 12345
        assert blocks.memory_budget_for(reserve=4 * 2**30, available=8 * 2**30) == 12345
    # an availability read earlier (auto_fit's predictions read it once) instead of reading it now
    assert blocks.memory_budget_for(reserve=2 * 2**30, available=8 * 2**30) == 3 * 2**30


def test_operator_store_leaves_the_preconditioners_matrices_free(monkeypatch):
    """The operator's engine, on the automatic budget, stores the rows of ``K_nM`` that fit half the available
    memory less the preconditioner's peak (``3 M^2`` doubles): with memory for all of ``K_nM`` plus a little,
    but not for that too, it stores part; with a budget given, what that budget allows."""
    from gpfalkon import NystromKRROperator
    from gpfalkon.backend.engine import stored_rows_for
    from gpfalkon.operators.preconditioner import preconditioner_bytes

    n, m = 60_000, 700  # K_nM float64: 336 MB, beyond the automatic budget's 256 MiB floor
    x = torch.randn(n, 2, dtype=torch.float64)
    kernel = gpytorch.kernels.RBFKernel().double()
    full = n * m * 8
    assert preconditioner_bytes(m) == 3 * 8 * m * m
    free = 2 * full + preconditioner_bytes(m) // 2  # half of it holds K_nM, not K_nM and the reserve
    monkeypatch.setattr(blocks, "available_memory", lambda device=None: free)
    op = NystromKRROperator(x, x[:m].clone(), torch.tensor(1e-3), kernel=kernel)
    budget = (free - preconditioner_bytes(m)) // 2
    assert op.engine.memory_budget == budget and not op.engine.stored
    assert op.engine.stored_rows == stored_rows_for(n, m, 8, budget, op.engine.block_rows, d=2) < n
    op2 = NystromKRROperator(x, x[:m].clone(), torch.tensor(1e-3), kernel=kernel, memory_budget=full)
    assert op2.engine.stored and op2.engine.stored_rows == n
    # store_kernel=True asks for all of K_nM: the automatic budget then keeps no reserve (half the available
    # memory holds K_nM here, so it is stored rather than refused)
    op3 = NystromKRROperator(x, x[:m].clone(), torch.tensor(1e-3), kernel=kernel, store_kernel=True)
    assert op3.engine.memory_budget == free // 2 and op3.engine.stored and op3.engine.stored_rows == n


def test_available_memory_reads_this_host():
    free = blocks.available_memory()
    # Linux (CI): /proc/meminfo; elsewhere None and the fallback
    assert free is None or 0 < free < 2**50
    b = blocks.default_memory_budget()
    assert blocks.AUTO_BUDGET_FLOOR <= b <= blocks.AUTO_BUDGET_CAP


def test_no_code_path_toggles_gpytorch_skip_posterior_variances(monkeypatch):
    """FalkonGP.posterior_mean, FalkonClassifier.decision_function, tuning's and auto_fit's
    validation errors compute means without entering GPyTorch's process-wide flag."""

    entered: list[str] = []

    def forbidden(self, *a, **k):  # recorded: auto_fit catches exceptions of its stages
        entered.append("skip_posterior_variances")
        raise AssertionError("skip_posterior_variances entered")

    monkeypatch.setattr(gpytorch.settings.skip_posterior_variances, "__enter__", forbidden)
    x, y = make_data(150, 2)
    m = FalkonGP(x, y, kernel=make_kernel("rbf", 2), num_centers=20, penalty=1e-4).fit()
    m.eval()
    mean = m.posterior_mean(x[:7])
    with torch.no_grad():
        ref = m(x[:7]).mean  # the lazily-evaluated covariance is not touched by .mean
    torch.testing.assert_close(mean, ref)
    assert m.posterior_mean(x[:0]).shape == (0,)
    labels = (y > y.median()).long()
    clf = FalkonClassifier(x, labels, make_kernel("rbf", 2), num_centers=20, penalty=1e-4).fit()
    assert clf.decision_function(x[:5]).shape == (5,)
    from gpfalkon.tuning import _rmse

    assert _rmse(m, x[:10], y[:10]) >= 0
    fitted = auto_fit(x, y, budget=1e4, hyper_rows=60, hyper_centers=10, select_rows=100, min_centers=20,
                      max_centers=40, max_steps=4, eval_every=2, dtype=torch.float64)
    assert not [n for n in fitted.auto_report.notes if "fail" in n or "Error" in n], fitted.auto_report.notes
    assert entered == []
    assert gpfalkon.settings.max_cg_iterations.value() == 100


def test_boolean_environment_variables_are_parsed_strictly(monkeypatch):
    """``GPFALKON_FUSED_CPU`` (and ``GPFALKON_TRITON_AUTOTUNE``) take 1/true/yes/on or 0/false/no/off; anything else
    is an error naming the variable, not a silent "on"."""
    from gpfalkon.backend import fused
    from gpfalkon.settings import env_flag

    for raw, want in (("1", True), (" On ", True), ("yes", True), ("0", False), ("FALSE", False), ("off", False)):
        monkeypatch.setenv("GPFALKON_X", raw)
        assert env_flag("GPFALKON_X", not want) is want
    monkeypatch.delenv("GPFALKON_X")
    assert env_flag("GPFALKON_X", True) is True
    monkeypatch.setitem(fused._state, "enabled", None)
    for raw in ("maybe", "-1", "", "00"):
        monkeypatch.setenv("GPFALKON_FUSED_CPU", raw)
        with pytest.raises(ValueError, match="GPFALKON_FUSED_CPU"):
            fused.fused_available()
