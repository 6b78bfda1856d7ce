"""Function calling: request models (schemas.py), the prompt side (render.py) and one parser per
tool-call format the served families emit (hermes.py, qwen_xml.py); api/output.py applies the
parser to a streaming completion.

`choose_format` follows the model family, read from the chat template first (what the template
renders is what the model was trained to emit) and the config's `model_type` second:

| template contains / model_type | format | parser |
| --- | --- | --- |
| `<function=` (Qwen3.5, Qwen3.6, Qwen3-Coder), or a tool template of `qwen3_5*` / `qwen3_6*` without `<tool_call>` | XML parameters | qwen_xml |
| `<tool_call>` (Qwen2.5, Qwen3: `qwen2*`, `qwen3*`) | JSON in `<tool_call>` | hermes |
| anything else (e.g. SmolLM2) | JSON in `<tool_call>`, fallback prompt | hermes |

A template that never reads `tools` (SmolLM2's) gets the fallback prompt of render.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ddtree_server.api.tools import hermes, qwen_xml


@dataclass(frozen=True)
class ToolFormat:
    name: str                                          # "qwen_xml" or "hermes"
    parse: Callable[[str, dict[str, Any]], "tuple[str, str] | None"]
    native: bool                                       # the template renders `tools` itself


def template_source(tokenizer: Any) -> str:
    """The chat template's text ('' when none; the default one of a dict of named templates)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), "")
    return template if isinstance(template, str) else ""


def choose_format(template: str, model_type: str | None = None) -> ToolFormat:
    """The tool-call format of a model with chat template `template` (see the module table)."""
    native = "tools" in template
    kind = (model_type or "").lower()
    xml_family = native and "<tool_call>" not in template and kind.startswith(("qwen3_5", "qwen3_6"))
    if "<function=" in template or xml_family:
        return ToolFormat("qwen_xml", qwen_xml.parse, native)
    return ToolFormat("hermes", hermes.parse, native)
