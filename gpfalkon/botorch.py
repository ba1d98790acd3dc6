"""FalkonGP as a BoTorch model: ``from gpfalkon.botorch import FalkonModel``."""
from gpfalkon.integrations.botorch_model import FalkonModel

__all__ = ["FalkonModel"]
