# The two commands of the README:
#   make serve   install everything and start the server on configs/default.yaml
#   make test    install everything and run the whole test suite
.PHONY: install serve test bench-vs-vllm

install:
	bash scripts/install.sh

serve: install
	.venv/bin/dlora serve --config configs/default.yaml

test: install
	.venv/bin/python -m pytest

bench-vs-vllm: install
	.venv/bin/python bench/vs_vllm_server.py
