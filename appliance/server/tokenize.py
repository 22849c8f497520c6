"""The bodies of vLLM's /tokenize (a prompt, or chat messages) and /detokenize (token ids within the vocabulary)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from appliance.errors import RequestError
from appliance.server.protocol import (
    TEMPLATE_KWARGS_DOC,
    ChatMessage,
    TemplateKwargs,
    Text,
    TokenId,
    bounded_int,
    check_continue_final,
    own_template,
)
from appliance.server.tools import ToolsRequest


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: Text | None = None
    prompt: Text = None  # type: ignore[assignment] - one of prompt and messages (the validator checks)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None  # type: ignore[assignment]
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: TemplateKwargs | None = Field(None, description=TEMPLATE_KWARGS_DOC)
    tools: ToolsRequest | None = Field(None, description="The tools the chat template renders (as a chat request's).")
    chat_template: Text | None = Field(None, description="A chat template of the request's own, as a chat "
                                                         "request's (--trust-request-chat-template).")

    def own_template(self) -> str | None:
        """chat_template, or chat_template_kwargs.chat_template (as a chat request's)."""
        return own_template(self.chat_template, self.chat_template_kwargs)

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send either prompt or messages", "prompt")
        if self.messages is not None:
            check_continue_final(self.continue_final_message, self.add_generation_prompt, self.messages)
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text | None = None
    tokens: list[TokenId]


def detokenize_body(vocab_size: int) -> type[DetokenizeRequest]:
    """/detokenize's body for one model: token ids within its vocabulary."""
    return create_model("DetokenizeRequest", __base__=DetokenizeRequest, __doc__=DetokenizeRequest.__doc__,
                        tokens=(list[bounded_int(ge=0, le=vocab_size - 1)], ...))
