"""Dense small-matrix linear algebra (M x M): robust Cholesky, the Gram matrix of a triangular factor."""
from .cholesky import jittered_cholesky
from .gram import upper_gram, upper_matmul

__all__ = ["jittered_cholesky", "upper_gram", "upper_matmul"]
