"""The names of a Llama-family decoder layer's projections, as PEFT's `target_modules` and vLLM's
LoRA layers call them."""

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")  # attention
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_PROJECTIONS = (*QKVO, *MLP)
