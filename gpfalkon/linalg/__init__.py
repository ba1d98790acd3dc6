"""Dense small-matrix linear algebra (M x M): robust Cholesky."""
from .cholesky import jittered_cholesky

__all__ = ["jittered_cholesky"]
