"""Hyperparameter objectives (Meanti et al. 2022): ``objective = Name(model); loss = objective()``."""
from .base import NystromAggregates, NystromObjective
from .exact import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound
from .mll import OBJECTIVE_NAMES, NystromMarginalLogLikelihood
from .stochastic import StochasticNystromCompReg, nystrom_quadratic_forms

__all__ = [
           "GCV",
           "LOOCV",
           "OBJECTIVE_NAMES",
           "CompReg",
           "HoldOut",
           "NystromAggregates",
           "NystromCompReg",
           "NystromMarginalLogLikelihood",
           "NystromObjective",
           "SGPRBound",
           "StochasticNystromCompReg",
           "nystrom_quadratic_forms",
]
