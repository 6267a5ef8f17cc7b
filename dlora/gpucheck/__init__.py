"""`make gpu-check`: every check that needs a CUDA GPU, in one command, into one JSON report.

    python -m dlora.gpucheck [--out bench/gpu_check/result.json] [--backends vllm,triton,einsum]

Checks (docs/gpu.md): an engine starts with each LoRA backend on the tiny test model; its greedy
outputs equal HF + PEFT for the base model, each adapter, merged, unmerged and mixed steps with a
switch forced every step, and the base comes back bit-exact after the merges; merge/unmerge
times; the Triton kernels' achieved bandwidth against the device's copy bandwidth. Without a GPU
it says so and exits 0, so it is safe anywhere.

Modules: `cli` (arguments, the run), `machine` (what it ran on), `report` (the JSON and its
schema), `engine_check` (one backend's engine, run in a child process), `kernel_check`
(bandwidth), `oracle` (HF + PEFT greedy decoding).
"""
