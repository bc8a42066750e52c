"""`python -m benchmarks.report`: see the package's docstring."""

from benchmarks.report.page import main

raise SystemExit(main())
