"""``python -m firmware_bridge`` = ``firmware-bridge``."""

import sys

from firmware_bridge.cli import main

sys.exit(main())
