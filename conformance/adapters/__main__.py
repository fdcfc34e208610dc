"""``python -m conformance.adapters``: the built-ins whose framework is installed (see
:func:`main`)."""

from conformance.adapters import main

main()
