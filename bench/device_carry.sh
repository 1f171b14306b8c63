#!/usr/bin/env bash
# What a lent GPU machine (the `device` tool) lacks, downloaded here into .carry/ (ignored
# by git). Its image has torch, triton, transformers and numpy; radixserve's GPU tests and
# benches also need:
#
#   .carry/fi/    flashinfer-python (60 MB, pure Python; JIT-compiles its kernels there)
#   .carry/whl/   msgspec, apache-tvm-ffi (FlashInfer's and xgrammar's FFI), xgrammar, and
#                 pydantic with its dependencies (7 MB)
#
# The two together pass a call's 64 MiB, so a lease starts with one call that carries
# [".carry/fi"] and runs   bash bench/device_carry.sh --install .carry/fi
# and every call after carries [".carry/whl", ...] and starts with
#   source bench/device_carry.sh --env || exit 1;
# which installs .carry/whl once per machine and exports PYTHONPATH (the installs, libs/
# and the repository root), PYTHONUNBUFFERED and MAX_JOBS (FlashInfer's JIT). Installs go
# to /tmp/site, which lasts while the machine stays warm.
#
# Here:  bash bench/device_carry.sh      # download into .carry/fi and .carry/whl

_radixserve_site=/tmp/site

_radixserve_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$_radixserve_site" "$1"/*.whl
}

_radixserve_download() (
  set -euo pipefail
  tags=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  mkdir -p .carry/fi .carry/whl
  python3 -m pip download -q --no-deps "${tags[@]}" -d .carry/fi flashinfer-python==0.7.2.post1
  python3 -m pip download -q --no-deps "${tags[@]}" -d .carry/whl msgspec==0.22.0 \
    apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.8 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
  du -sh .carry/fi .carry/whl
)

case "${1:-}" in
  --install)
    _radixserve_install "$2"
    ;;
  --env)
    if [ ! -f "$_radixserve_site/.radixserve-whl" ]; then
      _radixserve_install .carry/whl && touch "$_radixserve_site/.radixserve-whl"
    fi &&
      export PYTHONPATH="$_radixserve_site:$PWD/libs:$PWD" PYTHONUNBUFFERED=1 MAX_JOBS=16
    ;;
  "")
    _radixserve_download
    ;;
  *)
    echo "usage: bash bench/device_carry.sh [--install DIR | --env]" >&2
    false
    ;;
esac
