"""A declared tool's OpenAI schema, at each compaction level.

Small context windows cannot afford every tool's full schema, so a schema is built at one of
``bumblebot.core.toolkit.SCHEMA_LEVELS`` compaction levels (``Registry.schemas(level)``):

* 0: as declared (``additionalProperties: false``);
* 1: brief descriptions, optional parameters without description, no ``additionalProperties``;
* 2: required parameters only, without descriptions or bounds;
* 3: as 2, and the registry leaves the optional tools out.

:func:`function_schema` builds one tool's entry from its pydantic argument model;
:func:`first_sentence` is the brief description a tool without one gets (``tools/mcp.py`` uses
it for its tools too).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["first_sentence", "function_schema"]

#: Keys whose value maps names to schemas (so a field named ``title`` is kept there).
_SCHEMA_MAPPINGS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
#: Keys whose value is data, not schema (kept as it is).
_SCHEMA_DATA = frozenset({"default", "enum", "const", "examples"})


def function_schema(
    name: str, description: str, brief: str | None, args_model: type[BaseModel], level: int = 0
) -> dict[str, Any]:
    """The OpenAI ``tools`` entry ``{"type": "function", "function": {...}}`` of a tool at a
    compaction ``level`` (see the module's docstring).

    Args:
        name: the tool's name.
        description: its full description (level 0).
        brief: its short description for levels 1 and up; ``None``: the first sentence of
            ``description``.
        args_model: the pydantic model its arguments are validated against.
        level: the compaction level.
    """
    parameters = _clean_schema(args_model.model_json_schema())
    parameters.setdefault("properties", {})
    if level >= 1:
        description = brief or first_sentence(description)
        required = set(parameters.get("required", ()))
        for key, prop in list(parameters["properties"].items()):
            if level >= 2 and key not in required:
                del parameters["properties"][key]
                continue
            prop.pop("default", None)
            if level >= 2 or key not in required:
                prop.pop("description", None)
            if level >= 2:
                for bound in ("minimum", "maximum", "minLength", "maxLength"):
                    prop.pop(bound, None)
    else:
        parameters["additionalProperties"] = False
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def first_sentence(text: str, limit: int = 90) -> str:
    """The first sentence of ``text`` (up to a ``.``, ``!`` or ``?`` followed by a space and a
    capital letter, or the end), cut to ``limit`` characters; linear in the text's length."""
    text = " ".join(text.split())
    end = len(text)
    for i, char in enumerate(text[: limit + 2]):
        if char in ".!?" and (i + 2 >= len(text) or (text[i + 1] == " " and text[i + 2].isupper())):
            end = i + 1
            break
    sentence = text[:end]
    return sentence if len(sentence) <= limit else sentence[: limit - 1].rstrip() + "…"


def _clean_schema(node: Any, mapping: bool = False) -> Any:
    """Drop pydantic's ``title`` noise from a JSON schema (not fields named ``title``)."""
    if isinstance(node, list):
        return [_clean_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    if mapping:
        return {key: _clean_schema(value) for key, value in node.items()}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA_DATA:
            out[key] = value
        else:
            out[key] = _clean_schema(value, mapping=key in _SCHEMA_MAPPINGS)
    return out
