"""Linear operators: the FALKON preconditioner and the Nyström KRR system."""
from .preconditioner import FalkonPreconditioner
from .nystrom import NystromKRROperator

__all__ = ["FalkonPreconditioner", "NystromKRROperator"]
