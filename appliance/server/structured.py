"""The `response_format` of a chat request (text, json_object, json_schema) and the grammar each asks for."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from appliance.engine.grammar import GrammarSpec


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


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    # tags that are not field names, so that error locations name only fields
    return {"text": "plain-format", "json_object": "plain-format", "json_schema": "schema-format"}.get(kind)


ResponseFormat = Annotated[Annotated[PlainFormat, Tag("plain-format")] | Annotated[SchemaFormat, Tag("schema-format")],
                           Discriminator(_format_tag, custom_error_type="response_format_type",
                                         custom_error_message='type must be "text", "json_object" or "json_schema"')]
