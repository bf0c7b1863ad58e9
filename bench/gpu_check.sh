#!/usr/bin/env bash
# What only a GPU can show (CUDA resume in fp32/bf16/fp16, pinned data loading, NCCL DDP and
# FSDP over every GPU, the pinned snapshot's cost, an own loop's steps/s against plain torch), in
# one command: bench/gpu_check.py says what each check does. On a machine without CUDA it runs
# the same checks on CPU with gloo.
#
#   bash bench/gpu_check.sh [--only resume-bf16,torchrun-fsdp,own-loop] [--keep]
#
# Python: $PY, else .venv/bin/python where `make setup` made one, else python3 (a GPU image's
# python3 holds a CUDA PyTorch). The trainer's other dependencies that such an image may lack
# travel as wheels in .whl/ (`bash bench/gpu_check.sh --fetch-wheels` here, where pip reaches
# PyPI; then carry .whl): they are installed into /tmp/spottrain-site, never over the image's.
# The report goes to stdout and to $OUT/gpu_check/gpu_check.md ($OUT: the device tool's folder).
set -euo pipefail
cd "$(dirname "$0")/.."

# What the trainer imports besides torch and numpy, as pip names them for --no-deps downloads.
WHEELS=(pydantic pydantic-core annotated-types typing-inspection typing-extensions safetensors google-crc32c blake3)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  for name in "${WHEELS[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$name"
  done
  ls .whl
  exit 0
fi

PY="${PY:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c 'import pydantic, safetensors, google_crc32c, blake3' 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/spottrain-site .whl/*.whl
    export PYTHONPATH="/tmp/spottrain-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: $PY lacks pydantic, safetensors, google_crc32c or blake3; run 'bash bench/gpu_check.sh --fetch-wheels' where pip reaches PyPI and carry .whl" >&2
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1
exec "$PY" -m bench.gpu_check "$@"
