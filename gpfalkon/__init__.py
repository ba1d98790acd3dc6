"""gpfalkon: FALKON (Nyström kernel ridge regression by preconditioned CG) for GPyTorch."""
from . import objectives, settings
from .centers import CenterSelection, UniformCenters, uniform_centers
from .errors import CGNotConvergedWarning, FalkonConvergenceError, JitterWarning, NotFittedError, NotPSDError
from .heuristics import median_lengthscale
from .kernels import KernelEngine
from .models import FalkonGP, NystromPosteriorFactors
from .operators import FalkonPreconditioner, NystromKRROperator
from .solvers import CGInfo, conjugate_gradient, falkon_solve

__version__ = "0.1.0"

__all__ = [
    "CGInfo",
    "CGNotConvergedWarning",
    "CenterSelection",
    "FalkonConvergenceError",
    "FalkonGP",
    "FalkonPreconditioner",
    "NystromPosteriorFactors",
    "JitterWarning",
    "KernelEngine",
    "NotFittedError",
    "NotPSDError",
    "NystromKRROperator",
    "UniformCenters",
    "conjugate_gradient",
    "falkon_solve",
    "median_lengthscale",
    "objectives",
    "settings",
    "uniform_centers",
]
