"""pytest-moe-ep: multi-rank worlds in pytest, and the expert-parallel checkpoint conformance
matrix.

Importing this package does not import torch.
"""

__version__ = "0.1.0"
