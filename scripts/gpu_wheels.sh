#!/usr/bin/env bash
# Wheels of the engine's packages that the GPU machine's image lacks (it has torch,
# transformers, numpy, tokenizers, safetensors, jinja2, pytest...; nothing can be downloaded
# there), for Python 3.12 on x86-64, into .whl/ (ignored by git; carried by the device run:
# carry=[".whl"]). scripts/gpu_check.sh installs them first. Run here, once, from the repo root.
set -euo pipefail
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
    "llguidance==$(python3 -c 'import importlib.metadata as m; print(m.version("llguidance"))')"
ls -l .whl
