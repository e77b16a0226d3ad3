"""`python -m swaserve` runs the CLI."""

import sys

from swaserve.cli import main

sys.exit(main())
