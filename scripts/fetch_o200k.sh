#!/usr/bin/env bash
# Put o200k_base.tiktoken (the vocabulary openai-harmony checks, sha256 below) into DIR (default:
# ${SWASERVE_CACHE:-~/.cache/swaserve}/o200k), where the GPT-OSS chat tests find it. Offline machines cannot
# download it from its origin, but the pure-Python wheel of litellm on PyPI ships the exact file (under
# tiktoken's cache name): this fetches that one wheel (no dependencies, not installed), takes the one
# member and checks its sha256. Run once per machine; CI's .ci/run runs it. Serving a real GPT-OSS
# checkpoint does not need it (the file is regenerated from the model's tokenizer.json).
set -euo pipefail

DIR=${1:-${SWASERVE_CACHE:-$HOME/.cache/swaserve}/o200k}
SHA256=446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d
WHEEL_VERSION=1.91.5  # a py3-none-any wheel (16.7 MB) holding the file
MEMBER=litellm/litellm_core_utils/tokenizers/fb374d419588a4632f3f557e76b4b70aebbca790
PY=${PYTHON:-python3}

if [ -f "$DIR/o200k_base.tiktoken" ] && echo "$SHA256  $DIR/o200k_base.tiktoken" | sha256sum -c --status; then
    exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: "litellm==$WHEEL_VERSION" -d "$TMP"
"$PY" - "$TMP"/litellm-*.whl "$MEMBER" "$TMP/o200k_base.tiktoken" <<'EOF'
import sys
import zipfile

wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, open(out, "wb") as f:
    f.write(z.read(member))
EOF
echo "$SHA256  $TMP/o200k_base.tiktoken" | sha256sum -c --status || { echo "fetch_o200k: sha256 mismatch" >&2; exit 1; }
mkdir -p "$DIR"
mv "$TMP/o200k_base.tiktoken" "$DIR/o200k_base.tiktoken"
echo "fetch_o200k: $DIR/o200k_base.tiktoken"
