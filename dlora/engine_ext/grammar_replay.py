"""A moved request's structured output resumes where it stopped, never from the start.

dlora moves a request by sending `prompt + generated` to another engine (migration, resubmission
after a replica loss). For free text that is the whole state; a structured output also has a
grammar state, which a fresh engine would start at the grammar's beginning, constraining the next
token as if nothing had been generated. The continuation carries how many of its prompt's last
tokens were generated (`SamplingParams.extra_args[GENERATED_BEFORE_KEY]`); once the engine's grammar
for it is compiled, those tokens are fed to it, as vLLM feeds each sampled token after a step.

Runs in the EngineCore process, called from `DloraScheduler._handle_blocked_waiting_request`.
"""

from __future__ import annotations

import logging

from vllm.v1.request import Request

from dlora.engine_ext.continuation_logits import earlier_legs_tokens

log = logging.getLogger(__name__)


def replay(structured_output_manager, request: Request) -> bool:
    """Advance the request's compiled grammar over the tokens its earlier legs generated; False
    when the grammar refuses them (the request then ends in an error, as one whose grammar did not
    compile: its output so far could not have come from this grammar)."""
    n = earlier_legs_tokens(request.sampling_params) if request.sampling_params is not None else 0
    if n <= 0 or not request.use_structured_output:
        return True
    tokens = list(request.prompt_token_ids[-n:]) if request.prompt_token_ids else []
    if structured_output_manager.accept_tokens(request, tokens):
        return True
    log.error("request %s: its grammar refused the %d tokens its earlier legs generated", request.request_id, n)
    return False
