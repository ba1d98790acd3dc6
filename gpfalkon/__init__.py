"""gpfalkon: FALKON (Nyström kernel ridge regression by preconditioned CG) for GPyTorch."""
from . import backend, objectives, settings
from .auto import AutoFitReport, auto_fit
from .backend import KernelEngine
from .backend.distributed import DistributedBackend, init_distributed, shard_range
from .backend.sources import NpyRows, ParquetRows, RowSource, TensorRows, shard_files, shard_rows
from .centers import (
    CenterSelection,
    CenterSelector,
    FixedCenters,
    LeverageCenters,
    NestedLeverageCenters,
    UniformCenters,
    approximate_leverage_scores,
    dictionary_leverage_scores,
    effective_dimension,
    leverage_centers,
    nested_leverage_centers,
    uniform_centers,
)
from .errors import (
    CGNotConvergedWarning,
    DistributedError,
    FalkonConvergenceError,
    JitterWarning,
    MemoryBudgetWarning,
    NotFittedError,
    NotPSDError,
)
from .heuristics import median_lengthscale
from .kernels import FastfoodKernel
from .models import FalkonClassifier, FalkonGP, NystromPosteriorFactors, PenaltyPath, encode_labels
from .objectives import NystromMarginalLogLikelihood
from .operators import FactorCache, FalkonPreconditioner, NystromKRROperator, PenaltyPathPreconditioner
from .options import FalkonOptions
from .solvers import CGInfo, Preconditioner, PreconditionerBuilder, Solver, conjugate_gradient, falkon_solve

__version__ = "0.2.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

__all__ = [
    "AutoFitReport",
    "CGInfo",
    "CGNotConvergedWarning",
    "CenterSelection",
    "CenterSelector",
    "DistributedBackend",
    "DistributedError",
    "FactorCache",
    "FalkonClassifier",
    "FalkonConvergenceError",
    "FalkonGP",
    "FalkonOptions",
    "FalkonPreconditioner",
    "FastfoodKernel",
    "FixedCenters",
    "JitterWarning",
    "KernelEngine",
    "LeverageCenters",
    "MemoryBudgetWarning",
    "NestedLeverageCenters",
    "NotFittedError",
    "NotPSDError",
    "NpyRows",
    "NystromKRROperator",
    "NystromMarginalLogLikelihood",
    "NystromPosteriorFactors",
    "ParquetRows",
    "PenaltyPath",
    "PenaltyPathPreconditioner",
    "Preconditioner",
    "PreconditionerBuilder",
    "RowSource",
    "Solver",
    "TensorRows",
    "UniformCenters",
    "approximate_leverage_scores",
    "auto_fit",
    "backend",
    "conjugate_gradient",
    "dictionary_leverage_scores",
    "effective_dimension",
    "encode_labels",
    "falkon_solve",
    "init_distributed",
    "leverage_centers",
    "median_lengthscale",
    "nested_leverage_centers",
    "objectives",
    "settings",
    "shard_files",
    "shard_range",
    "shard_rows",
    "uniform_centers",
]
