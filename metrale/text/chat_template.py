"""Chat templates: the model's own jinja template, rendered the way Hugging Face renders it.

A template comes with the model's tokenizer (metrale.text.tokenizer reads it from the GGUF metadata
or from a model folder's chat_template.jinja, chat_template.json or tokenizer_config.json), or, when
the model brings none, from the built-ins below (`ChatTemplate.for_tokenizer`). Rendering uses what `transformers.apply_chat_template` uses: an
`ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the loopcontrols extension,
`raise_exception`, `strftime_now`, a `tojson` filter that keeps non-ASCII text, and the special
tokens (bos_token, eos_token, ...) as variables. Each distinct template source is compiled once.

Messages are validated before rendering (ValueError naming the message and the field), and
content given as a list of text parts is joined with newlines (as vLLM does for text-only models).
A `developer` message is rendered as the template's developer turn when it names one, else as system.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from jinja2 import nodes
from jinja2.exceptions import UndefinedError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from metrale.errors import InvalidMessagesError

ROLES = ("system", "developer", "user", "assistant", "tool")

CHATML = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# Qwen3's format for system/user/assistant/tool turns: ChatML; an assistant turn's <think> part is
# dropped before the last user message and kept after it; enable_thinking=False pre-fills an empty
# think block. (Tool definitions in the system prompt are left to the model's own template.)
QWEN3 = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages %}
{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message['content'] %}
{%- if message['role'] == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if reasoning == '' and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# Gemma 3's format: <bos>, a system message folded into the first user turn, "assistant" rendered
# as "model", turn contents trimmed, user/model turns must alternate.
GEMMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '')
    + (message['content'] | trim) + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"""

# Llama 3's format (Meta's Llama 3 Instruct template): bos, then per turn a role header and the trimmed
# content closed by <|eot_id|>; a tool result is an "ipython" turn, as in Llama 3.1. (Tool definitions
# are left to the model's own template.)
LLAMA3 = """{%- for message in messages %}
{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}
{{- (bos_token if loop.first else '') + '<|start_header_id|>' + role + '<|end_header_id|>\n\n'
    + (message['content'] | trim) + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "qwen3": QWEN3, "gemma3": GEMMA3, "llama3": LLAMA3}
_BUILTIN_TOKENS: dict[str, tuple[str, str]] = {  # name -> (bos_token, eos_token)
    "chatml": ("", "<|im_end|>"), "qwen3": ("", "<|im_end|>"), "gemma3": ("<bos>", "<eos>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
}


class TemplateSource(Protocol):
    """What a template is read from: the model's tokenizer (metrale.text.tokenizer.Tokenizer)."""

    chat_template: str | None
    bos_token: str | None
    eos_tokens: tuple[str, ...]
    special_tokens: tuple[str, ...]


class ChatTemplateError(ValueError):
    """The template refused the messages (its raise_exception), e.g. roles that do not alternate."""


class ChatTemplate:
    """A compiled chat template plus the special tokens it may print."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 special_tokens: Mapping[str, str] | None = None, name: str = "model") -> None:
        """`special_tokens`: extra template variables such as unk_token / pad_token."""
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template source must be a non-empty string")
        self.source = source
        self.name = name
        self.special_tokens = {**(special_tokens or {}), "bos_token": bos_token, "eos_token": eos_token}
        self._template = _compile(source)
        # a template that names the developer role renders it (gpt-oss); others get it as system
        self.has_developer_role = "'developer'" in source or '"developer"' in source

    @classmethod
    def builtin(cls, name: str, *, bos_token: str | None = None, eos_token: str | None = None) -> "ChatTemplate":
        """One of BUILTIN_TEMPLATES ("chatml", "qwen3", "gemma3", "llama3") with its usual special tokens."""
        if name not in BUILTIN_TEMPLATES:
            raise ValueError(f"unknown built-in chat template {name!r}; choose one of {sorted(BUILTIN_TEMPLATES)}")
        default_bos, default_eos = _BUILTIN_TOKENS[name]
        return cls(BUILTIN_TEMPLATES[name], name=name, bos_token=default_bos if bos_token is None else bos_token,
                   eos_token=default_eos if eos_token is None else eos_token)

    @classmethod
    def for_tokenizer(cls, tokenizer: TemplateSource, architecture: str) -> "ChatTemplate":
        """The model's own template (read with its tokenizer from the GGUF metadata or the model
        folder), or the built-in that fits its architecture and special tokens when it has none."""
        bos = tokenizer.bos_token or ""
        eos = tokenizer.eos_tokens[0] if tokenizer.eos_tokens else ""
        if tokenizer.chat_template:
            return cls(tokenizer.chat_template, bos_token=bos, eos_token=eos)
        name = default_builtin(architecture, tokenizer.special_tokens)
        return cls.builtin(name, bos_token=bos or None, eos_token=eos or None)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages`. ValueError on bad messages or when the template refuses them.

        Extra keyword arguments (e.g. enable_thinking=False) become template variables. The result
        already holds any bos token the template prints: encode it without adding special tokens.
        """
        checked = validate_messages(messages)
        if not self.has_developer_role:  # OpenAI's newer name for the system turn
            checked = [{**m, "role": "system"} if m["role"] == "developer" else m for m in checked]
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=checked, add_generation_prompt=add_generation_prompt,
                                         tools=list(tools) if tools is not None else None, **variables)
        except UndefinedError as error:  # the template reads a field the request left out (a tool's description)
            raise ChatTemplateError(f"chat template: {error} (a field it reads is missing from the messages "
                                    f"or tools)") from error


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and content; return copies whose content is a string (text parts joined by "\\n").
    InvalidMessagesError (a ValueError, field "messages") names the message at fault."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidMessagesError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidMessagesError(f"messages[{index}] must be an object with 'role' and 'content', "
                             f"got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidMessagesError(f"messages[{index}].role must be one of {', '.join(ROLES)}; got {role!r}")
        entry = dict(message)
        entry["content"] = _content_text(index, role, message)
        checked.append(entry)
    return checked


def default_builtin(architecture: str, tokens: Sequence[str]) -> str:
    """The built-in that fits a model without a template: by architecture, then by its special tokens
    (a llama-architecture model whose vocabulary has Llama 3's turn headers gets Llama 3's format)."""
    arch = architecture.lower()
    if arch.startswith("gemma") or "<start_of_turn>" in tokens:
        return "gemma3"
    if arch.startswith("qwen3"):
        return "qwen3"
    if "<|start_header_id|>" in tokens and (arch.startswith("llama") or "<|im_start|>" not in tokens):
        return "llama3"
    return "chatml"


# ---- internals ----

def _content_text(index: int, role: str, message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and message.get("tool_calls"):
        return ""  # an assistant turn that only calls tools
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts = []
        for part_index, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidMessagesError(f"messages[{index}].content[{part_index}] must be "
                                 f"{{'type': 'text', 'text': <string>}}; only text parts are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidMessagesError(f"messages[{index}].content must be a string or a list of text parts, "
                     f"got {type(content).__name__}")


class _GenerationTag(Extension):
    """HF's {% generation %} ... {% endgeneration %} marks assistant text for training masks; render the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    return _environment().from_string(source)
