"""Linear operators: the FALKON preconditioner and the Nyström KRR system."""
from .nystrom import NystromKRROperator
from .preconditioner import FalkonPreconditioner

__all__ = ["FalkonPreconditioner", "NystromKRROperator"]
