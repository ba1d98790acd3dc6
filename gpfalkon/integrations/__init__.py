"""Integrations with other libraries (BoTorch)."""
