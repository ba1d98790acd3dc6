"""Hyperparameter objectives (Meanti et al. 2022): ``objective = Name(model); loss = objective()``."""
from .base import NystromAggregates, NystromObjective
from .exact import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound
from .stochastic import StochasticNystromCompReg, nystrom_quadratic_forms

__all__ = ["CompReg", "GCV", "HoldOut", "LOOCV", "NystromAggregates", "NystromCompReg", "NystromObjective", "SGPRBound",
           "StochasticNystromCompReg", "nystrom_quadratic_forms"]
