# The two commands of the README:
#   make serve   install everything and start the server on configs/default.yaml
#   make test    install everything and run the whole test suite
#   make gpu-check  on a GPU machine: the GPU-only checks -> bench/results/gpu_check.json (docs/gpu.md)
.PHONY: install serve test bench-vs-vllm gpu-check

install:
	bash scripts/install.sh

serve: install
	.venv/bin/dlora serve --config configs/default.yaml

test: install
	.venv/bin/python -m pytest

bench-vs-vllm: install
	.venv/bin/python bench/vs_vllm_server.py

gpu-check: install
	.venv/bin/python -m dlora.gpucheck --out bench/results/gpu_check.json
