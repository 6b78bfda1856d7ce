"""Reasoning models: whether a chat template thinks, and whether a rendered prompt leaves the
model inside its reasoning.

Qwen3 / Qwen3.5 / Qwen3.6 write their reasoning inside `<think>...</think>` before the answer; the
Qwen3.5/3.6 templates open `<think>` at the end of the prompt themselves (the completion then
starts inside the reasoning), and with `chat_template_kwargs: {"enable_thinking": false}` they
write an empty `<think>\\n\\n</think>` into the prompt instead. api/output.py returns the reasoning
as `reasoning_content` (the field vLLM and SGLang use).
"""

from __future__ import annotations

from ddtree_server.api.output import THINK_CLOSE, THINK_OPEN


def thinks(template: str) -> bool:
    """True when the chat template knows the `<think>` markup."""
    return THINK_OPEN in template or THINK_CLOSE in template


def opened(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open `<think>` (the model continues its reasoning)."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN)
