"""`python -m swaserve.core`: one engine-core process (started by the server's frontend)."""

import sys

from swaserve.core.engine_core import main

sys.exit(main())
