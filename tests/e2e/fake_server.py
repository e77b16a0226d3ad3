"""`python tests/e2e/fake_server.py --port 0`: the real server (frontend + engine-core process) over
FakeEngine, for subprocess tests."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeTokenizer

from swaserve.core.engine_core import CoreSpec
from swaserve.options import add_server_flags, server_config
from swaserve.server.launch import run_server

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-delay", type=float, default=0.002)
    add_server_flags(parser)
    args = parser.parse_args()
    spec = CoreSpec("fake_engine:FakeEngine", {"step_delay": args.step_delay})
    sys.exit(run_server(spec, FakeTokenizer(), server_config(args)))
