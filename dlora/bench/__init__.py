"""`dlora bench`: a LoRA-aware load-test harness whose flags, printed block and JSON follow `vllm bench serve`.

Modules, one concept each:
- `popularity`: adapter shares (uniform, distinct, skewed, zipf, powerlaw, dLoRA stride);
- `arrivals`: Poisson/Gamma(CV) arrival times, diurnal modulation, merged per-adapter streams;
- `lengths`, `prompts`, `sharegpt`: request lengths (profiles or ShareGPT) and prompt text;
- `trace`: Azure Functions 2019 per-minute trace replay mapped to adapters as in dLoRA;
- `workload`: `WorkloadSpec` → `generate_workload` → `list[Request]`, JSONL save/load;
- `client`: streaming OpenAI client timing TTFT/ITL/E2EL; `runner`: `run_benchmark`, `run_sweep`;
- `report`, `summary`, `plot`: metrics, the printed block, PNGs; `cli`, `command`: the subcommand;
- `adapter_slo`: per-adapter SLO attainment and normalized latency against a dlora server's SLOs.

Shared by the benchmark scripts under bench/ (one folder per question; no script imports another
benchmark's):
- `servers`: random adapters, server processes started, healthy and stopped (`serving`, `dlora_server`);
- `scrape`: a server's /metrics text and the samples read from it; `poller`: scrapes during a run;
- `stats`: `percentile` and medians over reps; `results`: the result JSON and its PNG;
- `shipped`: configs/default.yaml's sections; `server_configs`: vLLM's server command and dlora
  configs built from one `EngineSettings`;
- `server_comparison`: servers compared on one mixed-adapter workload, runs alternated;
- `policy_servers`: one point of a batching-policy comparison; `cost_presets`: the LoRA backend of
  each simulated step-cost preset;
- `cluster_bench`: the two-replica cluster benchmark's settings, configs, workloads and calibration;
- `palette`: one colour per policy in every figure; `provenance`: date, commit, machine, command.
"""
