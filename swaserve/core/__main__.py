"""`python -m swaserve.core`: one engine-core process (started by the server's frontend)."""

import sys

from swaserve.core.engine_core import main

if __name__ == "__main__":  # not when a tensor-parallel rank, spawned from the core, imports this module
    sys.exit(main())
