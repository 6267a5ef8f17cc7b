# The two commands of the README:
#   make serve   install everything and start the server on configs/default.yaml
#   make test    install everything and run the whole test suite
# Development:
#   make test-fast  the tests that start no vLLM engine, `dlora serve` process or Ray cluster
#                   (`pytest --fast`: skips tests marked `engine`, fails an unmarked one that starts any)
#   make lint       ruff (lint + format check), mypy and import-linter's package layers, configured in
#                   pyproject.toml
#   make gpu-check  on a GPU machine: the GPU-only checks -> bench/gpu_check/result.json (docs/gpu.md)
.PHONY: install serve test test-fast lint bench-vs-vllm gpu-check

install:
	bash scripts/install.sh

serve: install
	.venv/bin/dlora serve --config configs/default.yaml

test: install
	.venv/bin/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder  # tests/schedule.py

test-fast: install
	.venv/bin/python -m pytest --fast

lint: install
	.venv/bin/ruff check
	.venv/bin/ruff format --check
	.venv/bin/mypy
	.venv/bin/lint-imports

bench-vs-vllm: install
	.venv/bin/python -m bench.vs_vllm_server.run

gpu-check: install
	.venv/bin/python -m dlora.gpucheck --out bench/gpu_check/result.json
