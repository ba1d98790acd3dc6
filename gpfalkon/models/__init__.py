"""GPyTorch models built on FALKON."""
from .classification import FalkonClassifier, encode_labels
from .falkon_gp import FalkonGP, NystromPosteriorFactors
from .posterior import NystromPosteriorCovariance

__all__ = ["FalkonClassifier", "FalkonGP", "encode_labels", "NystromPosteriorCovariance", "NystromPosteriorFactors"]
