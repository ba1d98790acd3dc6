"""GPyTorch models built on FALKON."""
from .falkon_gp import FalkonGP, NystromPosteriorFactors

__all__ = ["FalkonGP", "NystromPosteriorFactors"]
