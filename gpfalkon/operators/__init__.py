"""Linear operators: the FALKON preconditioner and the Nyström KRR system."""
from .preconditioner import FalkonPreconditioner  # noqa: I001  (import order matters)
from .nystrom import NystromKRROperator

__all__ = ["FalkonPreconditioner", "NystromKRROperator"]
