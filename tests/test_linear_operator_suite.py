"""linear_operator's own upstream test suites, run on gpfalkon's two operators.

* :class:`~gpfalkon.operators.NystromKRROperator` (``H = K_Mn K_nM + n lambda K_MM``)
  against :class:`linear_operator.test.linear_operator_test_case.LinearOperatorTestCase`.
  The reference ``evaluate_linear_op`` forms ``H`` densely and *differentiably* from the
  operator's representation ``(x, centers, penalty)`` through GPyTorch with the same
  kernel, so every upstream gradient check compares our blockwise / implicit-function
  gradients with plain autograd through the dense formula.
* :class:`~gpfalkon.operators.FalkonPreconditioner` (``B = n^-1/2 D T^-1 A^-1``, square
  but *not* symmetric) against ``RectangularLinearOperatorTestCase`` (the symmetric
  suite's solve / Cholesky / eigh / logdet checks assume a symmetric PSD matrix). The
  reference is ``n^-1/2 diag(w) T^-1 A^-1`` formed densely from ``(T, A, weights)``.

Everything runs in float64: the default dtype is float64 during each upstream test
(they draw right-hand sides with ``torch.randn``), and restored afterwards.

Upstream tests overridden with a skip (each states why): the batch-mode tests of the
Nyström operator (it is one ``M x M`` system with no batch mode; their non-batch parts
are re-checked below) and ``test_half`` (gpfalkon supports float32 / float64 only).
"""
from __future__ import annotations

import math
import unittest
from unittest.mock import MagicMock, patch

import gpytorch
import linear_operator
import pytest
import torch
from linear_operator.operators import LinearOperator
from linear_operator.test.linear_operator_test_case import (
    LinearOperatorTestCase,
    RectangularLinearOperatorTestCase,
)
from linear_operator.utils.memoize import get_from_cache
from torch import Tensor

import gpfalkon
from gpfalkon.operators import FalkonPreconditioner, NystromKRROperator

N, M, D = 60, 7, 3
PENALTY = 1e-2

_NO_BATCH = (
    "NystromKRROperator is a single M x M system (one data set, one set of centers) with no "
    "batch mode; this upstream test needs the operator expanded/unsqueezed to batch dimensions "
    "(it now raises a clear NotImplementedError, checked in test_batch_mode_raises_clearly)"
)


def _make_kernel() -> gpytorch.kernels.Kernel:
    kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=D)).double()
    kernel.base_kernel.lengthscale = torch.tensor([[0.9, 1.3, 0.7]], dtype=torch.float64)
    kernel.outputscale = torch.tensor(1.7, dtype=torch.float64)
    return kernel


def _data(seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    centers = x[torch.randperm(N, generator=g)[:M]].clone()
    return x, centers


def dense_h(kernel: gpytorch.kernels.Kernel, x: Tensor, centers: Tensor, penalty: Tensor) -> Tensor:
    """``K_Mn K_nM + n lambda K_MM``, dense and tracked by autograd (GPyTorch kernel calls)."""
    knm = kernel(x, centers).to_dense()
    kmm = kernel(centers, centers).to_dense()
    return knm.mT @ knm + x.shape[0] * penalty * kmm


def dense_b(T: Tensor, A: Tensor, weights: Tensor, n: int, transposed: bool = False) -> Tensor:
    """``n^-1/2 diag(w) T^-1 A^-1`` (or its transpose), dense and tracked by autograd.

    ``T`` and ``A`` are upper-triangular factors and the operator reads only their upper
    triangles (triangular solves), so the reference does too: otherwise autograd through
    ``inv`` would give the (structurally zero) lower triangles a gradient the operator
    rightly does not have.
    """
    b = (weights.unsqueeze(-1) * torch.linalg.inv(T.triu()) @ torch.linalg.inv(A.triu())) / math.sqrt(n)
    return b.mT if transposed else b


def _make_h(**kwargs) -> NystromKRROperator:
    x, centers = _data()
    return NystromKRROperator(x, centers, torch.tensor(PENALTY, dtype=torch.float64), kernel=_make_kernel(), **kwargs)


# Importing BoTorch (tests/test_botorch.py) changes linear_operator's global defaults
# (its __init__ turns the fast_* computations off and raises max_cholesky_size /
# cholesky_max_tries); the upstream suite assumes linear_operator's own defaults.
_LO_DEFAULTS = (
    (linear_operator.settings._fast_covar_root_decomposition, "_default", True),
    (linear_operator.settings._fast_log_prob, "_default", True),
    (linear_operator.settings._fast_solves, "_default", True),
    (linear_operator.settings.max_cholesky_size, "_global_value", 800),
    (linear_operator.settings.cholesky_max_tries, "_global_value", 3),
)


class _Float64Mixin:
    """Run each upstream test with float64 as the default dtype and linear_operator's
    own default settings (both restored afterwards)."""

    def setUp(self) -> None:
        self._old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        self._old_settings = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in _LO_DEFAULTS]
        for cls, attr, value in _LO_DEFAULTS:
            setattr(cls, attr, value)
        super().setUp()  # type: ignore[misc]

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        for cls, attr, value in self._old_settings:
            setattr(cls, attr, value)
        torch.set_default_dtype(self._old_dtype)


# ============================================================================ H
class TestNystromKRROperator(_Float64Mixin, LinearOperatorTestCase, unittest.TestCase):
    seed = 0
    # torch.linalg.solve(H, b) / linear_operator.solve is FALKON (gpfalkon's own
    # preconditioned CG), never linear_operator.utils.linear_cg, whatever max_cholesky_size says
    should_call_cg = False
    # root / diagonalisation decompositions are linear_operator's generic Lanczos on our _matmul
    should_call_lanczos = True
    should_call_lanczos_diagonalization = True

    def create_linear_op(self) -> NystromKRROperator:
        # Our solve is always FALKON CG, also in the upstream "*_cholesky" variants that
        # expect a direct solve's accuracy; the upstream tests' cg_tolerance(1e-4) would
        # leave ~5e-5 relative errors, failing rtol=0.03 on the smallest gradient entries.
        return _make_h(tol=1e-10)

    def evaluate_linear_op(self, linear_op: NystromKRROperator) -> Tensor:
        x, centers, penalty = linear_op.representation()
        return dense_h(linear_op.kernel, x, centers, penalty)

    def _test_inv_quad_logdet(self, reduce_inv_quad=True, cholesky=False, linear_op=None):
        # The logdet is linear_operator's generic stochastic Lanczos quadrature
        # (InvQuadLogdet), which tridiagonalises H *with linear_cg*; only solve() is
        # FALKON. So for this helper (and only here) linear_cg is expected whenever the
        # Cholesky path is off; every value / gradient check of the helper is unchanged.
        with patch.object(type(self), "should_call_cg", True):
            return super()._test_inv_quad_logdet(
                reduce_inv_quad=reduce_inv_quad, cholesky=cholesky, linear_op=linear_op
            )

    # ---------------------------------------------------------------- skips
    @unittest.skip(_NO_BATCH + " (adds a (2, M, M) tensor); non-batch part: test_add_nonbatch")
    def test_add(self):
        pass

    @unittest.skip(_NO_BATCH + " (cat_rows with batch_shape (2,)); non-batch part: test_cat_rows_nonbatch")
    def test_cat_rows(self):
        pass

    @unittest.skip(_NO_BATCH + " (expand to (3, M, M))")
    def test_expand(self):
        pass

    @unittest.skip(_NO_BATCH + " (reshape(-1, M, M) adds a batch dimension)")
    def test_reshape(self):
        pass

    @unittest.skip(_NO_BATCH + " (unsqueeze(-3))")
    def test_squeeze_unsqueeze(self):
        pass

    @unittest.skip("gpfalkon supports float32 and float64 only: a float16 operator is rejected by design")
    def test_half(self):
        pass

    # ------------------------------------------- non-batch parts of the skipped tests
    def test_add_nonbatch(self):
        linear_op = self.create_linear_op()
        evaluated = self.evaluate_linear_op(linear_op)
        rhs = torch.randn(linear_op.shape)
        self.assertAllClose((linear_op + rhs).to_dense(), evaluated + rhs)
        self.assertAllClose((rhs + linear_op).to_dense(), evaluated + rhs)
        self.assertAllClose(torch.add(linear_op, rhs).to_dense(), evaluated + rhs)
        self.assertAllClose(torch.add(rhs, linear_op).to_dense(), evaluated + rhs)
        self.assertAllClose((linear_op + linear_op).to_dense(), evaluated * 2)

    def test_cat_rows_nonbatch(self):
        linear_op = self.create_linear_op()
        evaluated = self.evaluate_linear_op(linear_op)
        new_rows = 1e-4 * torch.randn(1, linear_op.shape[-1])
        new_point = torch.rand(1, 1)
        concatenated = torch.cat(
            (torch.cat((evaluated, new_rows), dim=-2), torch.cat((new_rows.mT, new_point), dim=-2)), dim=-1
        )
        new_lt = linear_op.cat_rows(new_rows, new_point)
        self.assertAllClose(new_lt.to_dense(), concatenated)
        rhs = torch.randn(linear_op.size(-1) + 1)
        root_rhs = linear_operator.root_decomposition(new_lt).matmul(rhs)
        self.assertAllClose(root_rhs, concatenated @ rhs, **self.tolerances["root_decomposition"])
        root_inv = get_from_cache(new_lt, "root_inv_decomposition")
        concat_solve = torch.linalg.solve(concatenated, rhs)
        rel = (root_inv.matmul(rhs) - concat_solve).norm() / concat_solve.norm()
        self.assertLess(float(rel.detach()), self.tolerances["root_inv_decomposition"]["rtol"])

    def test_batch_mode_raises_clearly(self):
        linear_op = self.create_linear_op()
        for make in (
            lambda: linear_op.expand(3, M, M),
            lambda: linear_op.unsqueeze(0),
            lambda: linear_op + torch.randn(2, M, M),
        ):
            with self.assertRaisesRegex(NotImplementedError, "no batch mode"):
                make()
        self.assertIs(linear_op.expand(M, M), linear_op)

    def test_slices_empty_stepped_and_tensor_indices(self):
        """Slices (stepped, empty: the generic interpolation route divided by zero there) and tensor
        indices give the dense operator's entries."""
        linear_op = self.create_linear_op()
        dense = self.evaluate_linear_op(linear_op)
        idx = torch.tensor([4, 0, 4])
        for rows, cols in ((slice(M, M + 4), slice(0, 2)), (slice(1, None, 3), slice(None, None, 2)),
                           (slice(2, 5), idx), (idx, slice(0, 0)), (slice(0, 3), slice(None))):
            with torch.no_grad():
                got = linear_op[rows, cols].to_dense()
            self.assertAllClose(got, dense[rows, cols], rtol=1e-10, atol=1e-10)


class TestNystromKRROperatorGenericKernel(TestNystromKRROperator):
    """The same suite with a kernel off the engine's stationary fast path (a sum of an RBF
    and a linear kernel: every block goes through GPyTorch)."""

    def create_linear_op(self) -> NystromKRROperator:
        x, centers = _data()
        kernel = (
            gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()) + gpytorch.kernels.LinearKernel()
        ).double()
        assert gpfalkon.kernels.stationary_spec(kernel) is None
        return NystromKRROperator(x, centers, torch.tensor(PENALTY), kernel=kernel, tol=1e-10)


# ============================================================================ B
class TestFalkonPreconditioner(_Float64Mixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    seed = 0

    def create_linear_op(self) -> FalkonPreconditioner:
        _, centers = _data()
        with torch.no_grad():
            kmm = _make_kernel()(centers, centers).to_dense()
        g = torch.Generator().manual_seed(1)
        weights = 0.5 + torch.rand(M, generator=g, dtype=torch.float64)  # a non-trivial D
        return FalkonPreconditioner.from_kernel_matrix(kmm, PENALTY, N, weights=weights)

    def evaluate_linear_op(self, linear_op: FalkonPreconditioner) -> Tensor:
        T, A, w = linear_op.representation()
        return dense_b(T, A, w, linear_op.n, linear_op.transposed)

    def test_solve_exact(self):
        # B is not symmetric: linear_operator's generic solve (Cholesky / CG) assumes SPD
        # and used to return a wrong answer; FalkonPreconditioner.solve is exact.
        linear_op = self.create_linear_op().detach().requires_grad_(True)
        linear_op_copy = torch.clone(linear_op).detach().requires_grad_(True)
        evaluated = self.evaluate_linear_op(linear_op_copy)
        rhs = torch.randn(M, 3, requires_grad=True)
        lhs = torch.randn(2, M)
        rhs_copy = rhs.detach().clone().requires_grad_(True)
        with torch.no_grad():
            for max_chol in (0, 10**9):
                with linear_operator.settings.max_cholesky_size(max_chol):
                    self.assertAllClose(torch.linalg.solve(linear_op, rhs), torch.linalg.solve(evaluated, rhs))
                    vec = rhs[:, 0]
                    self.assertAllClose(torch.linalg.solve(linear_op, vec), torch.linalg.solve(evaluated, vec))
                    self.assertAllClose(
                        linear_operator.solve(linear_op, rhs, lhs), lhs @ torch.linalg.solve(evaluated, rhs)
                    )
        grad = torch.randn(M, 3)
        torch.linalg.solve(linear_op, rhs).backward(grad)
        torch.linalg.solve(evaluated, rhs_copy).backward(grad)
        self.assertAllClose(rhs.grad, rhs_copy.grad)
        for arg, arg_copy in zip(linear_op.representation(), linear_op_copy.representation(), strict=False):
            self.assertAllClose(arg.grad, arg_copy.grad, rtol=1e-6, atol=1e-8)

    def test_identity_b_bt(self):
        # docs/math.md §3: with eps -> 0, B B^T = ((n/M) K_MM D^2 K_MM + n lambda K_MM)^{-1}
        _, centers = _data()
        with torch.no_grad():
            kmm = _make_kernel()(centers, centers).to_dense()
        op = self.create_linear_op()
        if op.transposed:
            op = op.mT
        b = self.evaluate_linear_op(op)
        d2 = torch.diag(op.weights.square())
        target = torch.linalg.inv(N / M * kmm @ d2 @ kmm + N * PENALTY * kmm)
        torch.testing.assert_close(b @ b.mT, target, rtol=1e-6, atol=1e-8)


class TestFalkonPreconditionerTransposed(TestFalkonPreconditioner):
    """The same suite on ``B^T = n^-1/2 A^-T T^-T D`` (the ``transposed=True`` operator)."""

    def create_linear_op(self) -> FalkonPreconditioner:
        op = super().create_linear_op().mT
        assert isinstance(op, FalkonPreconditioner) and op.transposed
        return op


# ============================================ solve: no dense fallback, kernel gradients
@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def test_solve_ignores_max_cholesky_size_and_differentiates_kernel_params(float64_default):
    """Under ``max_cholesky_size(10**9)`` (which sends linear_operator's generic solve to a
    dense Cholesky), ``torch.linalg.solve(H, b)`` still runs FALKON: no Cholesky, no
    ``to_dense`` of ``H``, no ``linear_cg``, forward or backward. Its gradients w.r.t. the
    kernel's lengthscale and outputscale (parameters of the kernel, not of the operator's
    representation) and w.r.t. every representation tensor and the right-hand side match
    autograd through the dense formula."""
    x, centers = _data()
    x.requires_grad_(True)
    centers.requires_grad_(True)
    penalty = torch.tensor(PENALTY, requires_grad=True)
    kernel = _make_kernel()
    op = NystromKRROperator(x, centers, penalty, kernel=kernel, tol=1e-12, max_iter=200)
    _ = op.preconditioner  # FALKON's own M x M factorisations of K_MM happen here, before the patch

    torch.manual_seed(3)
    rhs = torch.randn(M, 2, requires_grad=True)
    grad_out = torch.randn(M, 2)

    chol = MagicMock(wraps=torch.linalg.cholesky)
    chol_ex = MagicMock(wraps=torch.linalg.cholesky_ex)
    cg = MagicMock(wraps=linear_operator.utils.linear_cg)
    with linear_operator.settings.max_cholesky_size(10**9), patch("torch.linalg.cholesky", new=chol), patch(
        "torch.linalg.cholesky_ex", new=chol_ex
    ), patch("linear_operator.utils.linear_cg", new=cg), patch.object(
        NystromKRROperator, "to_dense", autospec=True, side_effect=NystromKRROperator.to_dense
    ) as to_dense:
        sol = torch.linalg.solve(op, rhs)
        sol.backward(grad_out)
        assert not chol.called and not chol_ex.called, "solve fell back to a dense Cholesky"
        assert not cg.called and not to_dense.called
        # positive control: the generic LinearOperator.solve *does* densify under this setting
        LinearOperator.solve(op, rhs.detach())
        assert to_dense.called and (chol.called or chol_ex.called)

    params = [kernel.base_kernel.raw_lengthscale, kernel.raw_outputscale]
    g_params = [p.grad.clone() for p in params]
    g_ours = [x.grad.clone(), centers.grad.clone(), penalty.grad.clone(), rhs.grad.clone()]
    for t in [x, centers, penalty, rhs, *params]:
        t.grad = None

    h = dense_h(kernel, x, centers, penalty)
    ref = torch.linalg.solve(h, rhs)
    ref.backward(grad_out)
    torch.testing.assert_close(sol, ref.detach(), rtol=1e-8, atol=1e-10)
    for ours, p in zip(g_params, params, strict=False):
        torch.testing.assert_close(ours, p.grad, rtol=1e-6, atol=1e-9)
    for ours, t in zip(g_ours, [x, centers, penalty, rhs], strict=False):
        torch.testing.assert_close(ours, t.grad, rtol=1e-6, atol=1e-9)


def test_lengthscale_gradient_with_stored_and_streamed_engine(float64_default):
    """The lengthscale gradient of a scalar of the solve is right whether the engine stores
    ``K_nM`` or recomputes it in blocks, and whether the gradient pass runs in one block or
    in four (``gpfalkon.settings.block_rows(16)``, n = 60)."""
    torch.manual_seed(4)
    rhs = torch.randn(M)
    for store, block_rows in ((True, None), (False, 16)):
        op = _make_h(tol=1e-12, max_iter=200, store_kernel=store, block_rows=block_rows)
        kernel = op.kernel
        with linear_operator.settings.max_cholesky_size(10**9), gpfalkon.settings.block_rows(block_rows or 2048):
            loss = (torch.linalg.solve(op, rhs) ** 2).sum()
            (g,) = torch.autograd.grad(loss, kernel.base_kernel.raw_lengthscale)
        x, centers, penalty = op.representation()
        ref_loss = (torch.linalg.solve(dense_h(kernel, x, centers, penalty), rhs) ** 2).sum()
        (g_ref,) = torch.autograd.grad(ref_loss, kernel.base_kernel.raw_lengthscale)
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-10)
