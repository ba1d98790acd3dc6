"""Hyperparameter objectives (Meanti et al. 2022): ``objective = Name(model); loss = objective()``."""
from .base import NystromAggregates, NystromObjective
from .exact import GCV, LOOCV, CompReg, HoldOut, NystromCompReg, SGPRBound

__all__ = ["CompReg", "GCV", "HoldOut", "LOOCV", "NystromAggregates", "NystromCompReg", "NystromObjective", "SGPRBound"]
