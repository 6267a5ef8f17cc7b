"""Keys under which a replica passes dlora's settings into vLLM's engine core and its requests.

The replica host writes them (`dlora/replica/engine.py`); the code vLLM loads into the engine
(`dlora/engine_ext`) reads them. A leaf module, so the engine side reads the keys without importing
the host's AsyncLLM wrapper.
"""

# additional_config key under which the batching policy's settings reach the engine-core process
BATCHING_CONFIG_KEY = "dlora_batching"
# additional_config key: the engine priority from which a request is background (batch) work, which
# runs only in steps without online requests (dlora/scheduling/background.py)
BACKGROUND_PRIORITY_KEY = "dlora_background_priority"
# `SamplingParams.extra_args` key (vLLM hands extra_args to its engine core and model runner with
# the request): how many of a continuation's last prompt tokens its earlier legs generated, which
# its grammar replays (engine_ext/grammar_replay.py) and its penalties and bad words count as output
# (engine_ext/continuation_logits.py).
GENERATED_BEFORE_KEY = "dlora_generated_before"
