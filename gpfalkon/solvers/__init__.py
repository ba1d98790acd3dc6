"""Solvers: conjugate gradient, the preconditioned FALKON solve built on it, the direct
Nyström solve and the cost model choosing between them,
and the :class:`Preconditioner` / :class:`Solver` protocols the operators accept."""
from .cg import CGInfo, conjugate_gradient
from .direct import SolveCosts, choose_method, direct_solve_whitened
from .falkon import falkon_solve
from .protocols import Preconditioner, PreconditionerBuilder, Solver

__all__ = [
    "CGInfo",
    "Preconditioner",
    "PreconditionerBuilder",
    "SolveCosts",
    "Solver",
    "choose_method",
    "conjugate_gradient",
    "direct_solve_whitened",
    "falkon_solve",
]
