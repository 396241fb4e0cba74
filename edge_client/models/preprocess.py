"""Preprocessing lives in :mod:`edge_client.preprocess` (outside this package, whose import pulls
torch, so that a torch-free device can preprocess); this name stays for existing importers."""

from edge_client.preprocess import to_model_input, validate_images

__all__ = ["to_model_input", "validate_images"]
