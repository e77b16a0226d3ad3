"""`python tests/e2e/fake_server.py --port 0`: the real server over FakeEngine, for subprocess tests."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_engine import FakeEngine

from swaserve.options import add_server_flags
from swaserve.server.launch import serve_main

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--step-delay", type=float, default=0.002)
    add_server_flags(parser)
    args = parser.parse_args()
    sys.exit(serve_main(args, engine=FakeEngine(step_delay=args.step_delay)))
