"""FalkonGP as a BoTorch model: ``from gpfalkon.botorch import FalkonModel``.

Importing it also registers FalkonModel with BoTorch's pathwise samplers (:mod:`gpfalkon.integrations.pathwise`:
``draw_matheron_paths``, ``PathwiseThompsonSampling``, ``optimize_posterior_samples``)."""
from gpfalkon.integrations import pathwise as _pathwise  # noqa: F401  (registers the pathwise samplers)
from gpfalkon.integrations.botorch_model import FalkonModel

__all__ = ["FalkonModel"]
