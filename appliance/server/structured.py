"""The `response_format` of a chat request (text, json_object, json_schema, structural_tag), vLLM's structured-output
fields (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `structural_tag`, and `structured_outputs`
with `json`, `regex`, `choice`, `grammar`, `structural_tag`), and the grammar each asks for."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from appliance.engine.grammar import UNUSABLE_GRAMMAR, UNUSABLE_SCHEMA, GrammarSpec
from appliance.errors import RequestError

CONFLICT = "conflicting_fields"  # the error code of fields that contradict each other (no JSON Schema can say it)
GuidedJson = dict[str, Any] | str
GuidedChoice = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class PlainFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object"]

    def grammar(self) -> GrammarSpec | None:
        return GrammarSpec("json_object") if self.type == "json_object" else None


class SchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat

    def grammar(self) -> GrammarSpec | None:
        return GrammarSpec("json_schema", json.dumps(self.json_schema.schema_), "response_format.json_schema")


class TagStructure(BaseModel):
    """One structure of a structural tag's older form: its text begins with `begin`, then JSON of `schema`, then
    `end`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class StructuralTagFormat(BaseModel):
    """vLLM's structural_tag response format: xgrammar's structural tag (`format`: the output's structure, e.g.
    triggered_tags), or its older form (`structures` that may begin wherever one of the `triggers` is written; the text
    around them is free)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["structural_tag"]
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> StructuralTagFormat:
        if (self.format is None) == (self.structures is None and self.triggers is None):
            raise RequestError("a structural_tag has either format, or structures and triggers", "response_format",
                               CONFLICT)
        if self.format is None and (self.structures is None or self.triggers is None):
            raise RequestError("a structural_tag's structures need its triggers, and its triggers its structures",
                               "response_format", CONFLICT)
        return self

    def grammar(self) -> GrammarSpec | None:
        return GrammarSpec("structural_tag", json.dumps(self.model_dump(by_alias=True, exclude_none=True)),
                           "response_format")


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None  # (a type that is not text, such as an object, matches no tag: the discriminator's error)
    # tags that are not field names, so that error locations name only fields
    return {"text": "plain-format", "json_object": "plain-format", "json_schema": "schema-format",
            "structural_tag": "structural-tag-format"}.get(kind)


ResponseFormat = Annotated[Annotated[PlainFormat, Tag("plain-format")] | Annotated[SchemaFormat, Tag("schema-format")]
                           | Annotated[StructuralTagFormat, Tag("structural-tag-format")],
                           Discriminator(_format_tag, custom_error_type="response_format_type",
                                         custom_error_message='type must be "text", "json_object", "json_schema" or '
                                                              '"structural_tag"')]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar)."""

    # the schema says it too: at least one of them, not null
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"anyOf": [
        {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
        for name in ("json", "regex", "choice", "grammar", "structural_tag")]})

    json_: GuidedJson | None = Field(None, alias="json")
    regex: str | None = None
    choice: GuidedChoice | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # as vLLM's: a structural tag as JSON text


def guided_grammar(json_schema: GuidedJson | None, regex: str | None, choice: list[str] | None,
                   outputs: StructuredOutputs | None, grammar: str | None = None,
                   structural_tag: str | None = None) -> GrammarSpec | None:
    """The grammar of vLLM's structured-output fields (None when the request sets none); RequestError when it sets
    more than one, or JSON that is not a schema. A grammar is EBNF as xgrammar reads it (GBNF: `root ::= ...`); a
    structural tag JSON text of either form `StructuralTagFormat` takes."""
    given = [(name, value) for name, value in (("guided_json", json_schema), ("guided_regex", regex),
                                               ("guided_choice", choice), ("guided_grammar", grammar),
                                               ("structural_tag", structural_tag))
             if value is not None]
    if outputs is not None:
        given += [(f"structured_outputs.{name}", value) for name, value in (
            ("json", outputs.json_), ("regex", outputs.regex), ("choice", outputs.choice),
            ("grammar", outputs.grammar), ("structural_tag", outputs.structural_tag)) if value is not None]
        if not given or not given[-1][0].startswith("structured_outputs"):
            raise RequestError("structured_outputs needs one of json, regex, choice, grammar, structural_tag",
                               "structured_outputs")
    if len(given) > 1:
        raise RequestError(f"{' and '.join(n for n, _ in given)} each constrain the output; send one", given[1][0],
                           "conflicting_fields")
    if not given:
        return None
    param, value = given[0]
    if param.endswith("json"):
        value = _json_object(value, param, "a JSON schema", UNUSABLE_SCHEMA)
        return GrammarSpec("json_schema", json.dumps(value), param)
    if param.endswith("regex"):
        return GrammarSpec("regex", value, param)
    if param.endswith("grammar"):
        return GrammarSpec("ebnf", value, param)
    if param.endswith("structural_tag"):
        return structural_tag_spec(value, param)
    return GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(c) for c in value), param)


def structural_tag_spec(text: str, param: str) -> GrammarSpec:
    """The grammar of a structural tag sent as JSON text (vLLM's structural_tag fields): either form of
    `StructuralTagFormat`, its `type` optional; RequestError naming `param` otherwise."""
    value = _json_object(text, param, "a structural tag", UNUSABLE_GRAMMAR)
    try:
        tag = StructuralTagFormat.model_validate({"type": "structural_tag", **value})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f".{part}" for part in first["loc"])
        raise RequestError(f"{param}{where}: {first['msg']}", param, UNUSABLE_GRAMMAR) from None
    except RequestError as exc:  # (the two forms mixed: named as this field)
        raise RequestError(f"{param}: {exc}", param, exc.code) from None
    return GrammarSpec("structural_tag", json.dumps(tag.model_dump(by_alias=True, exclude_none=True)), param)


def _json_object(value: Any, param: str, what: str, code: str) -> dict[str, Any]:
    """A JSON object given as itself or as JSON text; RequestError naming `param` (with `code`) otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{param}: not JSON ({exc.msg})", param, code) from None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: {what} is a JSON object", param, code)
    return value
