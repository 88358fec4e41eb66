"""FedSM engine: federated super-model training and inference for medical image segmentation.

The engine never imports Qt. The desktop app reaches it only through :mod:`engine.api`.
"""

__version__ = "0.1.0"
