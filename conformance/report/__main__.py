"""``python -m conformance.report``: the command line (:mod:`conformance.report_cli`)."""

import sys

from conformance.report_cli import main

sys.exit(main())
