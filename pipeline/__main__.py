"""``python -m pipeline`` is ``fleet-pipeline``."""

from pipeline.cli import main

raise SystemExit(main())
