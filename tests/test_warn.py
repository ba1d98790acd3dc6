"""gpfalkon's warnings name the user's line (gpfalkon._warn.warn_caller): whatever public call reaches a warning,
through gpfalkon's own layers, GPyTorch, linear_operator, torch's module hooks or BoTorch's wrapper,
``warning.filename`` is the file that made the call (this one)."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import gpytorch
import pytest
import torch

from gpfalkon import (
    FalkonGP,
    FalkonOptions,
    FalkonPreconditioner,
    NystromKRROperator,
    approximate_leverage_scores,
    falkon_solve,
    leverage_centers,
)
from gpfalkon._warn import caller_level, warn_caller
from gpfalkon.errors import CGNotConvergedWarning

CG = FalkonOptions(solve_method="cg")


def _data(n: int = 300, d: int = 2):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, d, generator=g, dtype=torch.float64)
    return x, torch.sin(3 * x.sum(1))


def _kernel() -> gpytorch.kernels.Kernel:
    return gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()


def _recorded(call: Callable[[], object], match: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    hits = [w for w in caught if match in str(w.message)]
    assert hits, [str(w.message)[:80] for w in caught]
    return hits


def _operator(max_iter: int = 1) -> tuple[NystromKRROperator, torch.Tensor]:
    x, y = _data()
    op = NystromKRROperator(x, x[:30], torch.tensor(1e-8, dtype=torch.float64), kernel=_kernel(), max_iter=max_iter,
                            tol=1e-12, options=CG)
    return op, op.kmn_y(y).detach()


def _max_iter_paths() -> dict[str, Callable[[], object]]:
    x, y = _data()
    op, rhs = _operator()
    pre = FalkonPreconditioner.from_kernel_matrix(op.kmm.detach(), 1e-8, x.shape[0])
    return {
        "FalkonGP.fit": lambda: FalkonGP(x, y, num_centers=50, penalty=1e-8, options=CG).fit(max_iter=1, tol=1e-12),
        "falkon_solve": lambda: falkon_solve(op.h_matmul_nograd, pre, rhs, tol=1e-12, max_iter=1),
        "operator.solve": lambda: op.solve(rhs),
        "torch.linalg.solve": lambda: torch.linalg.solve(op, rhs),
        "fit_penalty_path": lambda: FalkonGP(x, y, num_centers=30, penalty=1e-8, options=CG).fit_penalty_path(
            [1e-8, 1e-6], max_iter=1, tol=1e-12),
    }


@pytest.mark.parametrize("path", list(_max_iter_paths()))
def test_a_cg_warning_names_the_users_line_on_every_path(path):
    """CG's max_iter warning is 2 to 8 frames below the user's call depending on the path (gpfalkon's solver
    directly, the operator's solve through linear_operator and torch, the model's fit or penalty path)."""
    with torch.no_grad():
        hits = _recorded(_max_iter_paths()[path], "max_iter")
    assert all(w.filename == __file__ and issubclass(w.category, CGNotConvergedWarning) for w in hits), \
        [(w.filename, w.lineno) for w in hits]


def test_model_and_center_warnings_name_the_users_line():
    """Warnings from the operator (more centers than rows) through BoTorch's FalkonModel, from the center selection
    (fewer distinct rows than centers) through FalkonGP's constructor, from BLESS (its dictionary capped) through
    leverage_centers, from the memory budget (below one row) through a fit, and from the jittered Cholesky factor of an
    indefinite K_MM (repeated centers, shifted down) through the preconditioner's constructor."""
    from gpfalkon.botorch import FalkonModel

    x, y = _data(30)
    centers = torch.rand(60, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cases = [
        (lambda: FalkonModel(x, y[:, None], centers=centers, penalty=1e-4, options=CG), "centers for 30 training"),
        (lambda: FalkonGP(x[:5].repeat(100, 1), x[:5].repeat(100, 1).sum(1), num_centers=20, penalty=1e-6),
         "distinct rows"),
    ]
    xb, yb = _data(400)
    k = _kernel()
    k.base_kernel.lengthscale = 0.05
    repeated = torch.cat([xb[:20], xb[:20]])
    kmm_repeated = _kernel()(repeated, repeated).to_dense().detach() - 1e-4 * torch.eye(40, dtype=torch.float64)
    cases += [
        (lambda: leverage_centers(xb, 20, k, 1e-6, max_dictionary_size=10, min_dictionary_size=5), "capped"),
        (lambda: approximate_leverage_scores(xb, k, 1e-6, max_dictionary_size=10, min_dictionary_size=5), "capped"),
        (lambda: FalkonGP(xb, yb, num_centers=50, penalty=1e-6, memory_budget=64, options=CG).fit(max_iter=3, tol=0),
         "memory budget"),
        (lambda: FalkonPreconditioner.from_kernel_matrix(kmm_repeated, 1e-6, 400), "numerically singular"),
    ]
    for call, match in cases:
        hits = _recorded(call, match)
        assert all(w.filename == __file__ for w in hits), (match, [(w.filename, w.lineno) for w in hits])


def test_a_load_state_dict_hook_warning_names_the_users_line_at_any_nesting():
    """The alpha check runs in a hook inside torch's recursive load: its depth grows with the module's nesting."""
    x, y = _data()
    fitted = FalkonGP(x, y, kernel=gpytorch.kernels.MaternKernel(nu=2.5).double(), num_centers=30,
                      penalty=1e-6).fit()
    other = FalkonGP(x, y, kernel=gpytorch.kernels.MaternKernel(nu=1.5).double(), num_centers=30, penalty=1e-6)
    hits = _recorded(lambda: other.load_state_dict(fitted.state_dict()), "load_state_dict")
    nested = torch.nn.ModuleList([torch.nn.ModuleList([other])])
    state = torch.nn.ModuleList([torch.nn.ModuleList([fitted])]).state_dict()
    hits += _recorded(lambda: nested.load_state_dict(state), "load_state_dict")
    assert all(w.filename == __file__ for w in hits), [(w.filename, w.lineno) for w in hits]


def _level_here() -> int:
    import sys

    return caller_level(sys._getframe(0))


def test_caller_level_counts_only_frames_inside_gpfalkon_and_its_libraries():
    """From a frame outside gpfalkon the level is 1 (that frame); ``warn_caller`` called from outside gpfalkon names
    its caller."""
    assert _level_here() == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_caller("plain", RuntimeWarning)
    assert [(w.filename, w.category) for w in caught] == [(__file__, RuntimeWarning)]
