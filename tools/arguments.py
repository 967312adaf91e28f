"""A tool call's arguments: the model's JSON text read and validated against the tool's model.

Whatever goes wrong is said in words the model can act on ("arguments must be a JSON object,
got an array", "path: Field required"), never as a traceback: ``Registry.execute`` returns it
as the call's error result, and the tool is not run.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["validate_arguments"]

#: At most this many validation problems are listed in one error result.
_MAX_LISTED_ERRORS = 5


def validate_arguments(model: type[BaseModel], arguments: str | None) -> BaseModel | str:
    """``arguments`` (JSON text) validated as ``model``, or a message saying why they are not.

    ``""`` and ``"null"`` mean "no arguments" and are validated as ``{}`` (a model with
    required fields then fails validation); any other non-object JSON is an error.
    """
    parsed = _parse_arguments(arguments)
    if isinstance(parsed, str):
        return parsed
    try:
        return model.model_validate(parsed)
    except ValidationError as exc:
        return f"invalid arguments: {_describe(exc)}"


def _parse_arguments(arguments: str | None) -> dict[str, Any] | str:
    """The arguments object, or a message saying why there is none."""
    if arguments is None or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
        return f"arguments are not valid JSON ({detail}); send a JSON object"
    if value is None:
        return {}
    if not isinstance(value, dict):
        return f"arguments must be a JSON object, got {_json_type(value)}"
    return value


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__


def _describe(exc: ValidationError) -> str:
    """Pydantic's messages, one per problem, e.g. ``"path: Field required"``."""
    problems = exc.errors(include_url=False, include_context=False, include_input=False)
    parts = []
    for problem in problems[:_MAX_LISTED_ERRORS]:
        where = ".".join(str(part) for part in problem["loc"]) or "arguments"
        parts.append(f"{where}: {problem['msg']}")
    more = len(problems) - _MAX_LISTED_ERRORS
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)
