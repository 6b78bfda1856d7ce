"""Turn a validated API request into engine input: prompt token ids, SamplingParams, mode, budget.

* chat: the tokenizer's chat template renders the messages (with `add_generation_prompt=True`
  and the merged `chat_template_kwargs`), then the text is tokenised without extra special tokens;
* completions: the prompt is tokenised VERBATIM (no template, no system prompt); special tokens
  are added per the tokenizer's default, without doubling a BOS the text already starts with;
  token-id prompts are used as given after a vocabulary check.

Every client mistake raises `ApiError` (HTTP 4xx) here, before anything is queued or streamed.
A text that cannot fit the context window is refused BEFORE it is tokenised (`check_chars`): no
token covers more characters than the tokenizer's longest vocabulary entry (byte-level BPE and
SentencePiece entries spell one character per byte or character they cover), so a text of more
than ``max_model_len`` x that many characters needs more tokens than the window holds. A 10 MB
prompt then costs no tokenisation (~650 MB of memory for the SmolLM2 tokenizer); what passes is
tokenised and counted exactly (`sampling_params`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ddtree_server.api import reasoning
from ddtree_server.api.output import OutputParser
from ddtree_server.api.responses import ApiError
from ddtree_server.api.schemas import ChatCompletionRequest, CompletionRequest, check_text
from ddtree_server.api.tools import choose_format, template_source
from ddtree_server.api.tools.render import template_input
from ddtree_server.config import RESERVED_TEMPLATE_KWARGS

log = logging.getLogger("ddtree_server.api")

DEFAULT_TEMPERATURE = 1.0   # OpenAI's default when a request omits it


@dataclass
class Prepared:
    """Engine input for one request."""

    prompt_ids: list[int]
    params: Any               # engine.sampling.SamplingParams
    mode: str | None
    tree_budget: int | None


_TOKEN_CHARS: dict[int, int | None] = {}   # id(tokenizer) -> longest vocabulary entry (characters)


def max_token_chars(tokenizer: Any) -> int | None:
    """Characters of the tokenizer's longest vocabulary entry (added tokens included), computed
    once per tokenizer; None when the tokenizer has no ``get_vocab``."""
    key = id(tokenizer)
    if key not in _TOKEN_CHARS:
        try:
            vocab = tokenizer.get_vocab()
        except Exception:   # a tokenizer without a vocabulary listing: no character bound
            vocab = {}
        _TOKEN_CHARS[key] = max((len(token) for token in vocab), default=0) or None
    return _TOKEN_CHARS[key]


def check_chars(tokenizer: Any, chars: int, max_model_len: int | None, param: str) -> None:
    """Raise ApiError(400, context_length_exceeded) when a text of ``chars`` characters needs more
    than ``max_model_len`` tokens whatever the tokenizer does (see the module docstring)."""
    per_token = max_token_chars(tokenizer) if max_model_len else None
    if per_token and chars > max_model_len * per_token:
        raise ApiError(400, f"the prompt has {chars} characters, more than the context window of {max_model_len} "
                            f"tokens can hold ({per_token} characters at most per token); it was not tokenised",
                       param=param, code="context_length_exceeded")


@dataclass
class ChatPrompt:
    """A rendered chat request: prompt ids, the prompt text, and the parser of its completion."""

    ids: list[int]
    text: str
    parser: OutputParser
    markup: str = "hermes"     # the tool-call format (api/tools/): "hermes" or "qwen_xml"


def chat_prompt(tokenizer: Any, request: ChatCompletionRequest, default_kwargs: dict[str, Any],
                model_type: str | None = None, max_model_len: int | None = None) -> ChatPrompt:
    """Render the chat template (with the request's tools, api/tools/render.py) and tokenise it;
    the completion's parser splits reasoning (api/reasoning.py) and tool calls (api/output.py).
    Raises ApiError(400) on any template failure, a tool message that answers no call, or when
    the rendered text cannot fit ``max_model_len`` tokens (`check_chars`, before tokenising).

    `developer` messages are rendered as `system` (chat templates know no developer role).
    """
    kwargs = {**default_kwargs, **(request.chat_template_kwargs or {})}
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    template = template_source(tokenizer)
    if not template:
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    fmt = choose_format(template, model_type)
    messages, extra = template_input(request, fmt)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **extra, **kwargs)
    except Exception as exc:   # jinja errors, raise_exception() in templates, bad kwargs
        log.info("chat template error: %s", exc)
        raise ApiError(400, f"chat template error: {exc}", param="messages", code="chat_template_error") from None
    try:
        check_text(text)   # surrogates can only come from chat_template_kwargs here (messages are checked)
    except ValueError as exc:
        raise ApiError(400, f"chat_template_kwargs: {exc}", param="chat_template_kwargs") from None
    check_chars(tokenizer, len(text), max_model_len, "messages")
    tools = request.tools if request.tools and request.tool_choice != "none" else []
    thinking = reasoning.thinks(template)
    forced = forced_tool_choice(request) is not None   # the grammar starts the answer with a call
    parser = OutputParser(parse=fmt.parse if tools else None,
                          functions={tool.function.name: tool.function for tool in tools},
                          reasoning=thinking and not forced,
                          in_reasoning=thinking and not forced and reasoning.opened(text),
                          parallel=request.parallel_tool_calls is not False)
    return ChatPrompt(list(tokenizer.encode(text, add_special_tokens=False)), text, parser, fmt.name)


def chat_prompt_ids(tokenizer: Any, request: ChatCompletionRequest, default_kwargs: dict[str, Any],
                    max_model_len: int | None = None) -> list[int]:
    """Only the prompt ids of `chat_prompt`."""
    return chat_prompt(tokenizer, request, default_kwargs, max_model_len=max_model_len).ids


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int,
                          max_model_len: int | None = None) -> list[int]:
    """Token ids of a raw prompt. Raises ApiError(400) for ids outside [0, vocab_size), or for a
    text that cannot fit ``max_model_len`` tokens (`check_chars`, before tokenising)."""
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           param="prompt", code="invalid_token_id")
        return list(prompt)
    check_chars(tokenizer, len(prompt), max_model_len, "prompt")
    ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]   # the text already started with BOS and the tokenizer added another
    if not ids:
        raise ApiError(400, "prompt is empty after tokenisation", param="prompt")
    return ids


def check_decoding(request: ChatCompletionRequest | CompletionRequest, modes: set[str],
                   max_tree_budget: int) -> tuple[str | None, int | None]:
    """The per-request (mode, tree_budget) override. Raises ApiError(400) for a mode not available
    or a tree budget above `max_tree_budget` nodes (the server's --max-tree-budget)."""
    override = request.decoding
    if override is None:
        return None, None
    if override.mode is not None and override.mode not in modes:
        raise ApiError(400, f"decoding mode {override.mode!r} is not available on this server "
                            f"(available: {', '.join(sorted(modes))})", param="decoding.mode")
    if override.tree_budget is not None and override.tree_budget > max_tree_budget:
        raise ApiError(400, f"decoding.tree_budget {override.tree_budget} is above this server's limit of "
                            f"{max_tree_budget} nodes (--max-tree-budget)", param="decoding.tree_budget",
                       code="tree_budget_too_large")
    return override.mode, override.tree_budget


def grammar_for(engine: Any, request: ChatCompletionRequest | CompletionRequest, markup: str | None = None) -> Any:
    """The compiled grammar of the request's `response_format`, or of its forced tool calls
    (`tool_choice` "required" / a named function, in the tool-call `markup` of the model's format:
    "hermes" or "qwen_xml"); None for neither. Raises ApiError(400) naming the problem when the
    server refuses the format, schema or tools, or when both are asked for."""
    forced = forced_tool_choice(request)
    text = request.response_format is None or request.response_format.get("type") == "text"
    if text and forced is None:
        return None
    if forced is not None and not text:
        raise ApiError(400, "response_format and a tool_choice that forces a call cannot be combined",
                       param="response_format")
    from ddtree_server.constrained.limits import GrammarError

    try:
        if forced is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
            return engine.grammars.tool_calls(tools, forced, markup=markup or "hermes",
                                              parallel=request.parallel_tool_calls is not False)
        return engine.grammars.response_format(request.response_format)
    except GrammarError as exc:
        code = "invalid_tools" if forced is not None else "invalid_response_format"
        raise ApiError(400, str(exc), param=exc.param or ("tools" if forced is not None else "response_format"),
                       code=code) from None


def forced_tool_choice(request: Any) -> str | dict[str, Any] | None:
    """`"required"` or `{"type": "function", "function": {"name"}}` when the request forces a call."""
    choice = getattr(request, "tool_choice", None)
    if choice is None or choice in ("none", "auto") or not getattr(request, "tools", None):
        return None
    return choice if isinstance(choice, str) else choice.model_dump()


def sampling_params(request: ChatCompletionRequest | CompletionRequest, prompt_len: int,
                    max_model_len: int, params_cls: Any, defaults: dict[str, Any] | None = None, *,
                    vocab_size: int | None = None, grammar: Any = None) -> Any:
    """SamplingParams for the request. Raises ApiError(400) when the prompt (+ max_tokens) does
    not fit the context window of `max_model_len` tokens (max_tokens omitted -> the rest of it),
    for a `logit_bias` token id outside [0, vocab_size) and for top_logprobs without logprobs.
    temperature / top_p the request omits come from `defaults` (the model's generation_config,
    engine/defaults.py), else OpenAI's 1.0; top_k likewise (else off)."""
    limit = request.token_limit()
    param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
    if prompt_len >= max_model_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens but the context window is {max_model_len} "
                            f"tokens (at least one must be left to generate)",
                       param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    if limit is None:
        limit = max_model_len - prompt_len
    elif prompt_len + limit > max_model_len:
        told = param in getattr(request, "model_fields_set", {param})   # else the endpoint's default
        raise ApiError(400, f"prompt ({prompt_len} tokens) + {param} ({limit}{'' if told else ', the default'}) = "
                            f"{prompt_len + limit} tokens exceeds the context window of {max_model_len} tokens",
                       param=param, code="context_length_exceeded")
    defaults = defaults or {}
    temperature = request.temperature if request.temperature is not None else defaults.get(
        "temperature", DEFAULT_TEMPERATURE)
    top_p = request.top_p if request.top_p is not None else defaults.get("top_p", 1.0)
    extra = {}
    top_k = getattr(request, "top_k", None)
    if top_k is None:
        top_k = defaults.get("top_k")
    if top_k is not None and "top_k" in getattr(params_cls, "__dataclass_fields__", {}):
        extra["top_k"] = max(int(top_k), 0)   # vLLM's -1 = off
    bias = request.token_bias()
    bad = [t for t in bias if vocab_size is not None and t >= vocab_size]
    if bad:
        raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                       param="logit_bias", code="invalid_token_id")
    try:
        logprobs = request.logprob_count()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="top_logprobs") from None
    return params_cls(max_tokens=limit, temperature=temperature, top_p=top_p, seed=request.seed,
                      stop=list(request.stop), ignore_eos=request.ignore_eos,
                      presence_penalty=request.presence_penalty or 0.0,
                      frequency_penalty=request.frequency_penalty or 0.0,
                      repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                      logit_bias=bias, logprobs=logprobs, grammar=grammar, **extra)
