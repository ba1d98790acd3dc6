"""GPyTorch models built on FALKON."""
from .falkon_gp import FalkonGP, NystromPosteriorFactors
from .posterior import NystromPosteriorCovariance

__all__ = ["FalkonGP", "NystromPosteriorCovariance", "NystromPosteriorFactors"]
