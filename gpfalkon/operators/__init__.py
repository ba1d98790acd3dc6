"""Linear operators: the FALKON preconditioner and the Nyström KRR system."""
from .nystrom import NystromKRROperator
from .penalty_path import PenaltyPathPreconditioner
from .preconditioner import FactorCache, FalkonPreconditioner, PreconditionerFactor

__all__ = ["FactorCache", "FalkonPreconditioner", "NystromKRROperator", "PenaltyPathPreconditioner",
           "PreconditionerFactor"]
