"""Exceptions and warnings raised by gpfalkon."""
from __future__ import annotations

from linear_operator.utils.errors import NotPSDError

__all__ = [
    "CGNotConvergedWarning",
    "DistributedError",
    "FalkonConvergenceError",
    "JitterWarning",
    "MemoryBudgetWarning",
    "NotFittedError",
    "NotPSDError",
]


class FalkonConvergenceError(RuntimeError):
    """Conjugate gradient broke down: non-finite values, loss of positive
    definiteness, or a residual that stopped decreasing."""


class DistributedError(RuntimeError):
    """A collective of a sharded (distributed) run failed: another rank died, raised, or did
    not reach the same collective within the process group's timeout."""


class NotFittedError(RuntimeError):
    """Prediction was requested from a model whose ``fit()`` has not been run, or
    whose hyperparameters changed since the last ``fit()``."""


class CGNotConvergedWarning(RuntimeWarning):
    """CG reached its iteration cap before the requested relative residual."""


class JitterWarning(RuntimeWarning):
    """A Cholesky factorisation needed more diagonal jitter than the default
    (the kernel matrix is numerically singular, e.g. duplicate centers)."""


class MemoryBudgetWarning(RuntimeWarning):
    """The memory budget (:class:`gpfalkon.settings.memory_budget` or a ``memory_budget`` argument) is below what
    one row of a pass needs: the pass runs one row a block, over the budget by that row and far slower than
    with a budget of a few MiB."""
