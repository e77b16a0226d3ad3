# Sourced by the GPU scripts: the packages the GPU machine lacks (it has no network) come as wheels carried
# in .whl/ (gitignored; `pip download --no-deps --python-version 3.12 --only-binary=:all: -c constraints.txt
# PKG...`, e.g. the server's pyzmq msgspec fastapi starlette uvicorn opentelemetry-api). Each is installed
# into /tmp/site only where its module is missing, so the machine's own packages keep priority.
if compgen -G ".whl/*.whl" > /dev/null; then
    mkdir -p /tmp/site
    for w in .whl/*.whl; do
        mod=$(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z')
        [ "$mod" = pyzmq ] && mod=zmq
        [ "$mod" = apache_tvm_ffi ] && mod=tvm_ffi
        python3 -c "import $mod" 2> /dev/null || pip install -q --no-index --no-deps --target /tmp/site "$w" > /dev/null 2>&1
    done
    export PYTHONPATH=.:/tmp/site
fi
# GPT-OSS chat (harmony) needs the o200k_base vocabulary; the random-weight model directories carry a stand-in
# tokenizer it cannot be regenerated from, so carry the file (`bash scripts/fetch_o200k.sh .gpu_assets/o200k`).
if [ -f .gpu_assets/o200k/o200k_base.tiktoken ] && [ -z "${TIKTOKEN_ENCODINGS_BASE:-}" ]; then
    export TIKTOKEN_ENCODINGS_BASE="$PWD/.gpu_assets/o200k"
fi
