"""GPyTorch models built on FALKON."""
from .classification import FalkonClassifier, encode_labels
from .defaults import default_kernel, default_likelihood
from .falkon_gp import FalkonGP
from .penalty_path import PenaltyPath
from .posterior import NystromPosteriorCovariance, NystromPosteriorFactors, nystrom_posterior_mean

__all__ = [
    "FalkonClassifier",
    "FalkonGP",
    "NystromPosteriorCovariance",
    "NystromPosteriorFactors",
    "PenaltyPath",
    "default_kernel",
    "default_likelihood",
    "encode_labels",
    "nystrom_posterior_mean",
]
