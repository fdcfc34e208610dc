"""The conformance suite: adapters, the matrix and its checks.

Importing this package does not import torch; :func:`synthetic_grad` and :func:`synthetic_weight`
import it when called.
"""

from conformance.synthetic import synthetic_grad, synthetic_load, synthetic_tensor, synthetic_weight

__all__ = ["synthetic_grad", "synthetic_load", "synthetic_tensor", "synthetic_weight"]
