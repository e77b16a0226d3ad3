"""`python -m swaserve.server`: run the OpenAI-compatible server on its own (benchmarks, scripts)."""

from __future__ import annotations

import sys

from swaserve.server.launch import main

sys.exit(main())
