"""The request fields that restrict tokens, OpenAI's and vLLM's, mapped onto SamplingParams.

    response_format {"type": "json_object"}                       -> StructuredOutputs(json_object=True)
    response_format {"type": "json_schema", "json_schema": {"schema": ...}}   -> StructuredOutputs(json=...)
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   (vLLM >= 0.10)
    guided_json / guided_regex / guided_choice / guided_grammar                         (vLLM, older)
    logit_bias {"token id": bias}, allowed_token_ids [ids], bad_words [strings]         (sampling masks)

At most one constraint per request (a 400 names the fields that clash). Bad shapes are a 400 here; a
schema or grammar the grammar engine refuses is a 400 from `engine.prepare`, named after its field
by `prepare_error`.
"""

from __future__ import annotations

import re
from typing import Any

from metrale.server.errors import APIError, bad_request, from_engine_error
from metrale.structured_outputs import StructuredOutputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def constraint(request: Any) -> tuple[StructuredOutputs, str] | None:
    """The request's structured-output constraint and the field it came from, or None."""
    found: list[tuple[StructuredOutputs, str]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        found.append((_response_format(response_format), "response_format"))
    if request.structured_outputs is not None:
        found.append((_build("structured_outputs", lambda: StructuredOutputs.coerce(request.structured_outputs)),
                      "structured_outputs"))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            found.append((_build(name, lambda: StructuredOutputs(**{kind: value})), name))
    if len(found) > 1:
        names = [name for _, name in found]
        raise bad_request(f"only one structured-output constraint per request; got {', '.join(names)}", names[1])
    return found[0] if found else None


def sampling_fields(request: Any) -> dict[str, Any]:
    """SamplingParams keyword arguments for the token masks (validated there, by field name)."""
    fields: dict[str, Any] = {}
    if request.logit_bias:
        fields["logit_bias"] = _logit_bias(request.logit_bias)
    if request.allowed_token_ids is not None:
        fields["allowed_token_ids"] = request.allowed_token_ids
    if request.bad_words:
        fields["bad_words"] = request.bad_words
    found = constraint(request)
    if found is not None:
        fields["structured_outputs"] = found[0]
    return fields


def source_of(request: Any) -> str:
    """The field the request's constraint came from ("structured_outputs" when none)."""
    found = constraint(request)
    return found[1] if found is not None else "structured_outputs"


def prepare_error(error: Exception, source: str) -> APIError | None:
    """An error of `engine.prepare` as the 400 (or other status) naming the request field it concerns."""
    api_error = from_engine_error(error)
    if api_error is None:
        return None
    message = api_error.message
    if message.startswith("structured_outputs.") and source != "structured_outputs":
        message = f"{source}: {message.split(': ', 1)[-1]}"
    return APIError(api_error.status, message, param=source if api_error.status == 400 else None,
                    code=api_error.code)


def _response_format(response_format: Any) -> StructuredOutputs:
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True)
    if response_format.type != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, "
                          f"got {response_format.type!r}", "response_format")
    spec = response_format.json_schema
    if spec is None or spec.schema is None:
        raise bad_request("response_format json_schema needs json_schema.schema (the JSON schema)",
                          "response_format")
    return _build("response_format", lambda: StructuredOutputs(json=spec.schema), "response_format.json_schema.schema")


def _build(field: str, make: Any, name: str | None = None) -> StructuredOutputs:
    """make(); its ValueError as a 400 on `field`, the message naming `name` (default: the field)
    instead of StructuredOutputs' own field, e.g. "guided_choice must be a non-empty list ..."."""
    try:
        return make()
    except (ValueError, TypeError) as error:
        message = str(error)
        if field != "structured_outputs":
            message = re.sub(r"^structured_outputs(\.\w+)?", name or field, message)
        raise bad_request(message, field) from None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        # strictly ASCII decimal: int() would also take "+5", " 5", "1_0" and other scripts' digits
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(f"logit_bias keys must be token ids in decimal digits (0-9), got {key[:20]!r}",
                              "logit_bias")
        out[int(key)] = value
    return out
