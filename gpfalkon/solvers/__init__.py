"""Iterative solvers: conjugate gradient, the preconditioned FALKON solve built on it,
and the :class:`Preconditioner` / :class:`Solver` protocols the operators accept."""
from .cg import CGInfo, conjugate_gradient
from .falkon import falkon_solve
from .protocols import Preconditioner, PreconditionerBuilder, Solver

__all__ = ["CGInfo", "Preconditioner", "PreconditionerBuilder", "Solver", "conjugate_gradient", "falkon_solve"]
