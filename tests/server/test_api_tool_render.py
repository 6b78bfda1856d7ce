"""The prompt side of function calling and reasoning (api/prompts.py chat_prompt, api/tools/render.py)
on the real SmolLM2 tokenizer: its own template (no tool support: the fallback prompt) and the
same tokenizer given a small template of the Qwen kind (reads `tools`, iterates `arguments`,
opens `<think>` unless `enable_thinking` is false) written for this test."""

from __future__ import annotations

import copy
import json

import pytest

from ddtree_server.api.prompts import chat_prompt
from ddtree_server.api.responses import ApiError
from ddtree_server.api.schemas import ChatCompletionRequest

pytest_plugins = ["tests.server.api_fixtures"]
pytestmark = pytest.mark.slow

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
ANSWER = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
USER = {"role": "user", "content": "Weather in Paris?"}

NATIVE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{ tool.function.name + ': ' + (tool.function.parameters | tojson) + '\\n' }}{% endfor %}"
    "{{ 'Call with <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n"
    "</tool_call><|im_end|>\\n' }}{% endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '<tool_call>\\n<function=' + call.function.name + '>\\n' }}"
    "{%- for key, value in call.function.arguments | items %}"
    "{{ '<parameter=' + key + '>\\n' + value + '\\n</parameter>\\n' }}{% endfor %}"
    "{{ '</function>\\n</tool_call>' }}{% endfor %}"
    "{%- elif message.role == 'tool' %}{{ '<tool_response name=\"' + message.name + '\">' + message.content "
    "+ '</tool_response>' }}{% else %}{{ message.content }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def native(api_tokenizer):
    tokenizer = copy.deepcopy(api_tokenizer)
    tokenizer.chat_template = NATIVE
    return tokenizer


def render(tokenizer, **body):
    return chat_prompt(tokenizer, ChatCompletionRequest(**body), {})


def test_smollm2_template_ignores_tools_so_the_fallback_prompt_lists_them(api_tokenizer):
    prompt = render(api_tokenizer, messages=[USER, CALLED, ANSWER], tools=[TOOL])
    assert prompt.text.startswith("<|im_start|>system\nYou can call functions.")
    assert json.dumps(TOOL) in prompt.text and "You are a helpful AI assistant named SmolLM" not in prompt.text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt.text
    assert "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt.text
    assert prompt.parser.parse is not None and not prompt.parser.reasoning
    assert prompt.ids == api_tokenizer.encode(prompt.text, add_special_tokens=False)
    # a system message of the request keeps its text, the tool block follows it
    own = render(api_tokenizer, messages=[{"role": "system", "content": "Be brief."}, USER], tools=[TOOL],
                 parallel_tool_calls=False)
    assert own.text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert "Call at most one function per answer." in own.text and not own.parser.parallel


def test_tool_choice_none_leaves_tools_out_and_does_not_parse(api_tokenizer, native):
    for tokenizer in (api_tokenizer, native):
        prompt = render(tokenizer, messages=[USER, CALLED, ANSWER], tools=[TOOL], tool_choice="none")
        assert "get_weather: " not in prompt.text and "You can call functions" not in prompt.text
        assert prompt.parser.parse is None


def test_native_template_gets_tools_and_argument_objects(native):
    prompt = render(native, messages=[USER, CALLED, ANSWER], tools=[TOOL])
    assert 'get_weather: {"type": "object", "properties": {"city": {"type": "string"}}}' in prompt.text
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in prompt.text
    assert '<tool_response name="get_weather">sunny</tool_response>' in prompt.text
    assert prompt.parser.parse.__module__.endswith("qwen_xml")   # the template's <function= form


def test_thinking_template_starts_inside_reasoning_unless_disabled(native):
    prompt = render(native, messages=[USER])
    assert prompt.text.endswith("<think>\n") and prompt.parser.reasoning and prompt.parser.state == "reasoning"
    prompt.parser.feed("Paris is in France.\n</think>\n\nSunny.")
    prompt.parser.finish()
    assert prompt.parser.message() == {"role": "assistant", "reasoning_content": "Paris is in France.\n",
                                       "content": "Sunny."}
    off = render(native, messages=[USER], chat_template_kwargs={"enable_thinking": False})
    assert off.text.endswith("<think>\n\n</think>\n\n") and off.parser.state == "content"


def test_a_tool_message_must_answer_an_earlier_call(api_tokenizer):
    with pytest.raises(ApiError) as err:
        render(api_tokenizer, messages=[USER, ANSWER], tools=[TOOL])
    assert err.value.status == 400 and err.value.param == "messages.1.tool_call_id"
