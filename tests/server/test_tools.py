"""metrale.server.tools: history messages for the template (Mistral's 9-character call ids)."""

from __future__ import annotations

from metrale.server.tools import mistral_id, template_messages
from metrale.text.chat_template import ChatTemplate
from tests.llamacpp_assets import template_path

HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_0123456789abcdef01234567", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "12 C"}]


def test_mistral_templates_get_stable_nine_character_ids():
    short = mistral_id("call_0123456789abcdef01234567")
    assert len(short) == 9 and short.isalnum() and short == mistral_id("call_0123456789abcdef01234567")
    assert mistral_id("ab12CD34e") == "ab12CD34e"
    messages = template_messages(HISTORY, None, "mistral")
    assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == short
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    nemo = ChatTemplate(template_path("mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text(encoding="utf-8"))
    assert f'"id": "{short}"' in nemo.render(messages)
    assert template_messages(HISTORY, None, "hermes")[2]["tool_call_id"] == "call_0123456789abcdef01234567"
