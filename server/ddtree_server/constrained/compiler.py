"""Grammars for constrained decoding, compiled with xgrammar for one tokenizer (docs/constrained.md).

* ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}`` (any JSON
  object) and ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
* ``tool_calls(tools, choice, markup)``: the output must be tool calls in the model's markup,
  for ``tool_choice: "required"`` (one or more calls of any listed function) or a named function
  (exactly that one). Markups: ``hermes`` (Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``) and ``qwen_xml`` (Qwen3.5 / 3.6: ``<tool_call>\\n<function=NAME>\\n
  <parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``), via xgrammar's built-in
  structural tags ``qwen_3`` and ``qwen_3_5``.

xgrammar's length-bounded strings (``minLength`` / ``maxLength``) use the character class
``[^"\\\r\n]``, which admits raw control characters that JSON forbids in strings (a random test
model emits them); the JSON grammars are built as EBNF and that class is narrowed to the one of
xgrammar's own unbounded strings, ``[^\0-\x1f"\\]`` (the ``_json_grammar`` helper).

JSON is generated without free whitespace (xgrammar ``any_whitespace=False``: one line, ", " and
": " separators), so a small model cannot loop on blanks, and in strict mode (no properties the
schema does not list). Every refusal is a ``GrammarError`` (HTTP 400) naming the field: schema
checks in constrained/limits.py, then xgrammar's own message for what it cannot compile, and a
compile that runs longer than ``timeout_s`` seconds.

xgrammar was chosen over llguidance with measurements on the default model
(docs/benchmarks/grammar/): it ships a native draft-tree traversal (``traverse_draft_tree``) and
structural tags for both tool-call markups.
"""

from __future__ import annotations

import re

import concurrent.futures as futures
import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from ddtree_server.constrained.limits import MAX_SCHEMA_BYTES, GrammarError, check_schema

COMPILE_TIMEOUT_S = 10.0   # longest grammar compilation before the request is refused (s)
MAX_TOOLS = 128            # functions one tool grammar may list
MAX_TOOL_WHITESPACE = 4    # blanks between the elements of a tool call (a small model cannot loop on them)
_LOOSE_CHARS = r'[^\"\\\r\n]'   # EBNF text of xgrammar's length-bounded string characters
_JSON_CHARS = r'[^\0-\x1f\"\\]'    # ... and of its unbounded JSON string characters
MARKUPS = {"hermes": "qwen_3", "qwen_xml": "qwen_3_5"}   # our name -> xgrammar structural-tag model


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar for one request: ``kind`` ("json_object", "json_schema", "tool_calls")
    and xgrammar's ``CompiledGrammar`` (shared, read-only; each request gets its own matcher)."""

    kind: str
    compiled: Any


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
    """xgrammar ``TokenizerInfo`` over ``vocab_size`` logits columns (ids the tokenizer lacks are
    never allowed). HF tokenizers are read by xgrammar itself; a tokenizer that is not one must
    offer ``token_bytes(id) -> bytes`` for every id below ``len(tokenizer)`` (tests' byte tokenizer)."""
    import xgrammar as xgr

    stops = [int(t) for t in stop_token_ids]
    if hasattr(tokenizer, "token_bytes"):
        vocab = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=stops)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)


class GrammarCompiler:
    """Compiles request grammars for one tokenizer; thread-safe; caches compiled grammars
    (xgrammar's cache, keyed by the grammar text).

    Args:
        tokenizer: the engine's tokenizer; vocab_size: logits columns of the target;
        stop_token_ids: tokens that end a finished grammar (the engine's EOS ids);
        timeout_s: longest compile (seconds) before GrammarError.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        import xgrammar as xgr

        self.vocab_size = int(vocab_size)
        self.info = tokenizer_info(tokenizer, self.vocab_size, stop_token_ids)
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1)
        self.timeout_s = float(timeout_s)
        # one compile at a time; a compile past its time limit finishes in the background (it
        # cannot be interrupted) while the request has its 400 already
        self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._lock = threading.Lock()

    def _compile(self, what: str, param: str, fn, *args, **kwargs) -> Any:
        with self._lock:
            job = self._pool.submit(fn, *args, **kwargs)
        try:
            return job.result(timeout=self.timeout_s)
        except futures.TimeoutError:
            raise GrammarError(f"{param}: compiling the {what} grammar took longer than "
                               f"{self.timeout_s:g} s; simplify the schema", param) from None
        except (RuntimeError, ValueError, TypeError) as exc:   # xgrammar's refusal of a schema
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            detail = detail.split("] ", 1)[-1] if detail.startswith("[") else detail
            # a failed C++ check reads "/project/cpp/<file>.cc:974: Check failed: (cond) <why>": keep <why>
            detail = re.sub(r"^\S+\.(?:cc|cpp|h):\d+:\s*", "", detail)
            detail = detail.split(" is false: ", 1)[-1] if detail.startswith("Check failed:") else detail
            raise GrammarError(f"{param}: this server cannot compile the {what}: {detail}", param) from None

    def _json_grammar(self, schema_text: str, strict: bool):
        import xgrammar as xgr

        ebnf = str(xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=strict))
        return self._xgr.compile_grammar(ebnf.replace(_LOOSE_CHARS, _JSON_CHARS))

    def json_object(self) -> Grammar:
        """Any JSON object (``response_format: {"type": "json_object"}``)."""
        compiled = self._compile("JSON object", "response_format", self._json_grammar, '{"type": "object"}', False)
        return Grammar("json_object", compiled)

    def json_schema(self, schema: Any, *, param: str = "response_format.json_schema.schema") -> Grammar:
        """Output that validates against ``schema`` (a JSON Schema object)."""
        text = check_schema(schema, param)
        compiled = self._compile("JSON schema", param, self._json_grammar, text, True)
        return Grammar("json_schema", compiled)

    def response_format(self, fmt: dict[str, Any] | None) -> Grammar | None:
        """The grammar of an OpenAI ``response_format`` (None for text / absent)."""
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise GrammarError("response_format.json_schema must be an object with a 'schema'",
                                   "response_format.json_schema")
            if "schema" not in spec:
                raise GrammarError("response_format.json_schema.schema is missing",
                                   "response_format.json_schema.schema")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise GrammarError("response_format.json_schema.strict must be a boolean",
                                   "response_format.json_schema.strict")
            return self.json_schema(spec["schema"])
        raise GrammarError(f"response_format type {kind!r} is not supported (use 'text', 'json_object' "
                           "or 'json_schema')", "response_format.type")

    def tool_calls(self, tools: Sequence[dict[str, Any]], choice: str | dict[str, Any], *,
                   markup: str = "hermes", parallel: bool = True, reasoning: str = "disabled") -> Grammar:
        """Grammar forcing tool calls: ``choice`` is "required" or ``{"type": "function",
        "function": {"name": ...}}``; ``tools`` are OpenAI function tools; ``markup`` is "hermes"
        or "qwen_xml"; ``parallel`` False allows one call only. ``reasoning`` (xgrammar's modes):
        "disabled" = the calls come first; "enabled" = the prompt ends inside ``<think>`` (Qwen3.5 /
        3.6 with thinking on): free text up to ``</think>\n\n``, then the calls; "auto" = an
        optional ``<think>...</think>`` block first."""
        from xgrammar import builtin_structural_tag as tags

        if markup not in MARKUPS:
            raise GrammarError(f"unknown tool-call markup {markup!r} (use {', '.join(MARKUPS)})", "tools")
        if reasoning not in ("disabled", "enabled", "auto"):
            raise GrammarError(f"unknown reasoning mode {reasoning!r} (use disabled, enabled or auto)", "tools")
        functions = _functions(tools)
        if choice == "required":
            mode, chosen = "required", functions
        elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
            chosen = [f for f in functions if f["name"] == name]
            if not chosen:
                raise GrammarError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
            mode = {"type": "function", "function": {"name": name}}
        else:
            raise GrammarError("tool_choice must be \"required\" or {\"type\": \"function\", \"function\": "
                               "{\"name\": ...}} to constrain the output", "tool_choice")
        total = 0
        for i, fn in enumerate(chosen):
            check_schema(fn["parameters"], f"tools[{i}].function.parameters")
            total += len(json.dumps(fn["parameters"]))
        if total > 2 * MAX_SCHEMA_BYTES:
            raise GrammarError(f"the tools' parameter schemas total {total} bytes; the limit is "
                               f"{2 * MAX_SCHEMA_BYTES}", "tools")
        try:
            tag = tags.get_model_structural_tag(
                MARKUPS[markup], tools=[{"type": "function", "function": f} for f in chosen],
                tool_choice=mode, reasoning=reasoning, parallel_tool_calls=parallel,
                max_whitespace_cnt=MAX_TOOL_WHITESPACE)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"tools: {exc}", "tools") from None
        tag.format = calls_only(tag.format)
        compiled = self._compile("tool-call", "tools", self._xgr.compile_structural_tag, tag)
        return Grammar("tool_calls", compiled)


def calls_only(fmt):
    """A forced tool choice's answer is its calls and nothing after them: xgrammar's model tags
    leave free text around the calls (``triggered_tags``: any text, a call where a trigger
    appears), so a forced answer ran on after its call until max_tokens (finish_reason "length",
    made-up text as content). Each ``triggered_tags`` that must call (``at_least_one``) becomes
    ``tags_with_separator``: the calls one after another, a newline between them (as the
    templates join them), a newline at most, then the end of the answer (only EOS may follow)."""
    from xgrammar import structural_tag as st

    if isinstance(fmt, st.TriggeredTagsFormat) and fmt.at_least_one:
        calls = st.TagsWithSeparatorFormat(tags=fmt.tags, separator="\n", at_least_one=True,
                                           stop_after_first=fmt.stop_after_first)
        return st.SequenceFormat(elements=[calls, st.OptionalFormat(content=st.ConstStringFormat(value="\n"))])
    for name in ("elements", "content"):   # sequences (a reasoning block first) and nested tags
        inner = getattr(fmt, name, None)
        if isinstance(inner, list):
            setattr(fmt, name, [calls_only(f) for f in inner])
        elif inner is not None and hasattr(inner, "type"):
            setattr(fmt, name, calls_only(inner))
    return fmt


def _functions(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"name", "parameters"}]`` of OpenAI function tools; GrammarError for anything else."""
    if not tools:
        raise GrammarError("tool_choice requires tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise GrammarError(f"{len(tools)} tools; a constrained tool call may list at most {MAX_TOOLS}", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise GrammarError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        params = fn.get("parameters")
        out.append({"name": name, "parameters": params if params is not None else {"type": "object"}})
    return out
