"""gpfalkon: FALKON (Nyström kernel ridge regression by preconditioned CG) for GPyTorch."""
from . import backend, objectives, settings
from .auto import AutoFitReport, auto_fit
from .centers import (
    CenterSelection,
    CenterSelector,
    FixedCenters,
    LeverageCenters,
    UniformCenters,
    approximate_leverage_scores,
    effective_dimension,
    leverage_centers,
    uniform_centers,
)
from .errors import CGNotConvergedWarning, DistributedError, FalkonConvergenceError, JitterWarning, NotFittedError, NotPSDError
from .heuristics import median_lengthscale
from .backend import KernelEngine
from .backend.distributed import DistributedBackend, init_distributed, shard_range
from .backend.sources import NpyRows, ParquetRows, RowSource, shard_files, shard_rows
from .kernels import FastfoodKernel
from .models import FalkonClassifier, FalkonGP, NystromPosteriorFactors, encode_labels
from .objectives import NystromMarginalLogLikelihood
from .operators import FalkonPreconditioner, NystromKRROperator
from .options import FalkonOptions
from .solvers import CGInfo, Preconditioner, PreconditionerBuilder, Solver, conjugate_gradient, falkon_solve

__version__ = "0.1.0"

__all__ = [
    "AutoFitReport",
    "auto_fit",
    "approximate_leverage_scores",
    "backend",
    "effective_dimension",
    "leverage_centers",
    "CGInfo",
    "CGNotConvergedWarning",
    "DistributedBackend",
    "NystromMarginalLogLikelihood",
    "DistributedError",
    "init_distributed",
    "shard_range",
    "shard_files",
    "shard_rows",
    "NpyRows",
    "ParquetRows",
    "RowSource",
    "CenterSelection",
    "CenterSelector",
    "FixedCenters",
    "FalkonClassifier",
    "FalkonConvergenceError",
    "FalkonGP",
    "FalkonOptions",
    "FalkonPreconditioner",
    "FastfoodKernel",
    "NystromPosteriorFactors",
    "JitterWarning",
    "KernelEngine",
    "LeverageCenters",
    "NotFittedError",
    "NotPSDError",
    "NystromKRROperator",
    "Preconditioner",
    "PreconditionerBuilder",
    "Solver",
    "UniformCenters",
    "conjugate_gradient",
    "encode_labels",
    "falkon_solve",
    "median_lengthscale",
    "objectives",
    "settings",
    "uniform_centers",
]
