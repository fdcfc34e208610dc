"""Built-in conformance adapters."""
