"""The conformance suite: adapters, the matrix and its checks."""
