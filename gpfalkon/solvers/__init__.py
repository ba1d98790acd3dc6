"""Iterative solvers: conjugate gradient and the FALKON solve built on it."""
from .cg import CGInfo, conjugate_gradient
from .falkon import falkon_solve

__all__ = ["CGInfo", "conjugate_gradient", "falkon_solve"]
