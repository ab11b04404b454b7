"""``python -m gateway`` is the ``edge-gateway`` command."""

from gateway.cli import main

raise SystemExit(main())
