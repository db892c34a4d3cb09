"""StructuredOutputs: the constraint a request's output must satisfy (one of five kinds), validated at construction.

    StructuredOutputs(json={"type": "object", "properties": {...}})   a JSON schema (dict, bool or JSON text)
    StructuredOutputs(json_object=True)                                any JSON object
    StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}")                      the whole output matches (\\d, \\w are ASCII)
    StructuredOutputs(choice=["yes", "no"])                            exactly one of these strings
    StructuredOutputs(grammar='start: "a"+')                           a Lark or GBNF (llama.cpp) grammar

The names follow vLLM's `StructuredOutputsParams`. Only the shape and the size are checked here (this
module never imports the grammar engine); compiling the grammar, and with it the 400 for a schema the
engine cannot use, happens in metrale.sampling.guided, off the event loop. Never imports mlx.

Bounds, checked with cheap scans of the text before anything compiles (llguidance 1.9 recurses once per
link of a `$ref` or rule chain and overflows an 8 MiB stack at ~2,500 links; its rows hold at most 2,000
items, so a choice among 2,000 fails at its first token):

    text of a schema, grammar or regex, or all choices together   <= MAX_CONSTRAINT_CHARS
    "$ref" in a schema (or a grammar's inline %json)              <= MAX_REFS      (a chain is no longer)
    rules and terminals defined in a grammar                       <= MAX_GRAMMAR_RULES
    choices                                                         <= MAX_CHOICES
    optional properties of one object in a schema                  <= MAX_OPTIONAL_PROPERTIES
        (llguidance puts 4 row items per optional property in one row: 499 compile, then fail at the
        second token; required ones are generated in order and cost nothing there)
"""

from __future__ import annotations

import json as jsonlib
import re
from typing import Any

import msgspec

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CONSTRAINT_CHARS = 512 * 1024
MAX_REFS = 1024
MAX_GRAMMAR_RULES = 1024
MAX_CHOICES = 1024
MAX_OPTIONAL_PROPERTIES = 450
# a Lark rule or terminal ("name:", "?name:", "NAME.2:", "name{x}:") or a GBNF rule ("name ::="), at a line start
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:\{[^}\n]*\})?[ \t]*(?::|::=)", re.MULTILINE)


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of the fields is set.

    json: a JSON schema; a dict, a bool or its JSON text, stored as compact JSON text that keeps the
        key order (properties are generated in the order they are declared).
    regex: a regular expression the whole output must match (Rust regex syntax; \\d, \\w and \\s are ASCII).
    choice: the output is exactly one of these (non-empty) strings.
    grammar: a Lark grammar (llguidance's dialect) or a GBNF grammar.
    json_object: any JSON object (OpenAI's response_format {"type": "json_object"}).
    """

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            msgspec.structs.force_setattr(self, "json", _schema_text(self.json))
            _check_size("json", self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.regex is not None:
            _check_size("regex", self.regex)
        if self.choice is not None:
            msgspec.structs.force_setattr(self, "choice", _choices(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        if self.grammar is not None:
            _check_size("grammar", self.grammar)
            _check_rules(self.grammar)
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(chosen) if chosen else 'none'}")

    @property
    def kind(self) -> str:
        """"json" | "regex" | "choice" | "grammar" | "json_object"."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """(kind, spec): hashable, equal for equal constraints (the grammar cache's key)."""
        kind = self.kind
        return (kind, None if kind == "json_object" else getattr(self, kind))

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputs":
        """A StructuredOutputs as given, or built from a dict of its fields (a ValueError naming the field)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise ValueError(f"structured_outputs must set one of {', '.join(KINDS)}; got unknown fields {unknown}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, "
                         f"got {type(value).__name__}")


def _schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as error:
            raise ValueError(f"structured_outputs.json must be a JSON schema; got text that is not JSON "
                             f"({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object or a boolean), "
                         f"got {type(schema).__name__}")
    text = jsonlib.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    if len(text) <= MAX_CONSTRAINT_CHARS:  # a longer one is refused for its size
        _check_optional_properties(schema)
    return text


def _check_optional_properties(schema: Any) -> None:
    """Every object's optional properties within MAX_OPTIONAL_PROPERTIES (one pass, no recursion)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > MAX_OPTIONAL_PROPERTIES:
            required = node.get("required")
            required = {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()
            optional = sum(1 for name in properties if name not in required)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise ValueError(f"structured_outputs.json: an object may have at most {MAX_OPTIONAL_PROPERTIES} "
                                 f"optional properties (not in required), got {optional}")
        stack.extend(node.values())


def _choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {choice!r:.100}")
    if len(choice) > MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice must hold at most {MAX_CHOICES} strings, got {len(choice)}")
    for item in choice:
        if not isinstance(item, str) or not item:
            raise ValueError(f"structured_outputs.choice must hold non-empty strings, got {item!r:.100}")
    total = sum(len(item) for item in choice)
    if total > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured_outputs.choice must hold at most {MAX_CONSTRAINT_CHARS} characters in all, "
                         f"got {total}")
    return tuple(choice)


def _check_size(kind: str, text: str) -> None:
    """The text's length and its "$ref" count (a schema, or a grammar's inline %json) within bounds."""
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"structured_outputs.{kind} must be at most {MAX_CONSTRAINT_CHARS} characters, "
                         f"got {len(text)}")
    refs = text.count('"$ref"')
    if refs > MAX_REFS:
        raise ValueError(f"structured_outputs.{kind} must hold at most {MAX_REFS} \"$ref\", got {refs}")


def _check_rules(grammar: str) -> None:
    rules = sum(1 for _ in _RULE_DEFINITION.finditer(grammar))
    if rules > MAX_GRAMMAR_RULES:
        raise ValueError(f"structured_outputs.grammar must define at most {MAX_GRAMMAR_RULES} rules, got {rules}")
