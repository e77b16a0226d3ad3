#!/usr/bin/env bash
# Regenerate constraints.txt: install swaserve with its test extras into a fresh virtualenv (CPU torch,
# as CI does) and record the exact version of every package pip resolved. CI and the README's quick
# start install with `-c constraints.txt`, so a fresh machine gets these versions and no newer ones.
# Run it after changing the dependencies in pyproject.toml, then run the test suite and commit both.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=$(mktemp -d)/venv
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e ".[test]"
{
    echo "# Exact versions CI installs (bash scripts/lock_deps.sh regenerates this file; do not edit by hand)."
    echo "# Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m), CPU torch."
    # torch without its local label (+cpu), so a CUDA build of the same release also satisfies it.
    "$VENV/bin/pip" freeze --exclude-editable | grep -v '^swaserve' | sed 's/^\(torch==[^+]*\)+.*/\1/' | LC_ALL=C sort -f
} > constraints.txt
rm -rf "$(dirname "$VENV")"
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
