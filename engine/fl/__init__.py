"""Federated learning: aggregation maths, local training and the federated methods.

Everything here works on weight dicts (``name -> torch.Tensor``) and never touches a network:
the in-process simulation and the Flower transport run the same code.
"""
