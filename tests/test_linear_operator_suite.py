"""linear_operator's own upstream test suites, run on gpfalkon's two operators.

* :class:`~gpfalkon.operators.NystromKRROperator` (``H = K_Mn K_nM + n lambda K_MM``)
  against :class:`linear_operator.test.linear_operator_test_case.LinearOperatorTestCase`;
  the reference ``evaluate_linear_op`` forms ``H`` densely and *differentiably* from the
  operator's representation ``(x, centers, penalty)`` through GPyTorch, so every upstream
  gradient check compares our blockwise/implicit gradients with plain autograd.
* :class:`~gpfalkon.operators.FalkonPreconditioner` (``B = n^-1/2 D T^-1 A^-1``, square but
  not symmetric) against ``RectangularLinearOperatorTestCase``; the reference is
  ``n^-1/2 diag(w) T^-1 A^-1`` formed densely from ``(T, A, weights)``.

Everything runs in float64: the default dtype is switched to float64 for each test
(the upstream tests draw their right-hand sides with ``torch.randn``).
"""
from __future__ import annotations

import math
import unittest
from unittest.mock import MagicMock, patch

import gpytorch
import linear_operator
import pytest
import torch
from linear_operator.test.linear_operator_test_case import (
    LinearOperatorTestCase,
    RectangularLinearOperatorTestCase,
)
from torch import Tensor

from gpfalkon.operators import FalkonPreconditioner, NystromKRROperator

N, M, D = 60, 7, 3
PENALTY = 1e-2


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
    """``K_Mn K_nM + n lambda K_MM`` by plain autograd-tracked dense algebra."""
    knm = kernel(x, centers).to_dense()
    kmm = kernel(centers, centers).to_dense()
    return knm.mT @ knm + x.shape[0] * penalty * kmm


class _Float64Mixin:
    """Run each upstream test with float64 as the default dtype (restored afterwards)."""

    def setUp(self) -> None:
        self._old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        super().setUp()  # type: ignore[misc]

    def tearDown(self) -> None:
        super().tearDown()  # type: ignore[misc]
        torch.set_default_dtype(self._old_dtype)


# --------------------------------------------------------------------------- H
class TestNystromKRROperator(_Float64Mixin, LinearOperatorTestCase, unittest.TestCase):
    seed = 0
    # torch.linalg.solve(H, b) is FALKON (gpfalkon's own preconditioned CG), never linear_cg
    should_call_cg = False
    # root / diagonalisation fall back to linear_operator's generic Lanczos on our _matmul
    should_call_lanczos = True
    should_call_lanczos_diagonalization = True

    def create_linear_op(self) -> NystromKRROperator:
        x, centers = _data()
        return NystromKRROperator(x, centers, torch.tensor(PENALTY), kernel=_make_kernel(), tol=1e-12, max_iter=200)

    def evaluate_linear_op(self, linear_op: NystromKRROperator) -> Tensor:
        x, centers, penalty = linear_op.representation()
        return dense_h(linear_op.kernel, x, centers, penalty)


# --------------------------------------------------------------------------- B
class TestFalkonPreconditioner(_Float64Mixin, RectangularLinearOperatorTestCase, unittest.TestCase):
    seed = 0

    def create_linear_op(self) -> FalkonPreconditioner:
        x, centers = _data()
        kernel = _make_kernel()
        with torch.no_grad():
            kmm = kernel(centers, centers).to_dense()
        g = torch.Generator().manual_seed(1)
        weights = 0.5 + torch.rand(M, generator=g, dtype=torch.float64)
        return FalkonPreconditioner.from_kernel_matrix(kmm, PENALTY, N, weights=weights)

    def evaluate_linear_op(self, linear_op: FalkonPreconditioner) -> Tensor:
        T, A, w = linear_op.representation()
        eye = torch.eye(T.shape[-1], dtype=T.dtype)
        b = torch.diag(w) @ torch.linalg.inv(T) @ torch.linalg.inv(A) / math.sqrt(linear_op.n)
        return b.mT if linear_op.transposed else b
