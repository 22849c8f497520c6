"""What the ingress learns about a request before routing it, without a tokenizer: the chain of prompt-prefix
hashes (a replica that served a prompt with the same first chunks holds their KV pages in its prefix cache), an
estimate of the prompt's tokens, its SLO class, and the replicas to avoid on a retry.

A prompt is read as text (a completion's prompt, or a chat's tools and messages in order) or as token ids, cut into
chunks of CHUNK_BYTES bytes (CHUNK_IDS ids), and chunk k's hash covers chunks 0..k, so two prompts share hash k
exactly when they share their first k+1 chunks.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

CHUNK_BYTES = 128      # about 32 tokens of English text
CHUNK_IDS = 32
MAX_CHUNKS = 64        # affinity is decided by the first 8 KiB (2048 ids) of a prompt
BYTES_PER_TOKEN = 4.0  # the usual ratio of BPE tokenizers on English text
ORIGIN = uuid.uuid4().hex[:12]  # this process, as the ingress (and its router) that sends requests to replicas


@dataclass(frozen=True)
class RoutingHints:
    prefix: tuple[str, ...] = ()   # chain hashes of the prompt's leading chunks
    tokens: int = 0                # estimated prompt tokens
    chunk_tokens: float = 0.0      # estimated tokens per chunk
    slo_class: str | None = None
    origin: str = ""               # the ingress that routed it (replicas count what each one sent)
    avoid: tuple[str, ...] = field(default=())  # replicas that already failed this request

    def to_dict(self) -> dict[str, Any]:
        return {"prefix": list(self.prefix), "tokens": self.tokens, "chunk_tokens": self.chunk_tokens,
                "slo_class": self.slo_class, "origin": self.origin, "avoid": list(self.avoid)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "RoutingHints":
        d = d or {}
        return cls(prefix=tuple(d.get("prefix") or ()), tokens=int(d.get("tokens") or 0),
                   chunk_tokens=float(d.get("chunk_tokens") or 0.0), slo_class=d.get("slo_class"),
                   origin=str(d.get("origin") or ""), avoid=tuple(d.get("avoid") or ()))


def chain_hashes(chunks: list[bytes]) -> tuple[str, ...]:
    out, running = [], hashlib.blake2b(digest_size=8)
    for chunk in chunks[:MAX_CHUNKS]:
        running.update(chunk)
        out.append(running.copy().hexdigest())
    return tuple(out)


def _text_of(content: Any) -> str:
    """A chat message's content as text (a string, or the text parts of a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content, sort_keys=True)


def prompt_of(path: str, body: dict[str, Any]) -> str | list[int] | None:
    """The prompt of a completion or chat body as text or token ids; None when there is none to read (the replica
    answers the malformed body itself)."""
    if path.endswith("/responses"):  # the Responses API: instructions, then input (a string or messages)
        given = body.get("input")
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
        if not isinstance(messages, list):
            return None
        if isinstance(body.get("instructions"), str):
            messages = [{"role": "system", "content": body["instructions"]}, *messages]
        body = {"messages": messages}
    if path.endswith(("/chat/completions", "/responses")):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = [json.dumps(body["tools"], sort_keys=True)] if body.get("tools") else []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\x00{_text_of(m.get('content'))}\x01")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def prompts_of(path: str, body: dict[str, Any]) -> list[str | list[int]] | None:
    """The prompts of a /v1/completions batch (two or more strings or token-id lists); None for any other body."""
    prompt = body.get("prompt") if path.endswith("/completions") and not path.endswith("/chat/completions") else None
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompt):
        return None
    return prompt


def hints_for(path: str, body: dict[str, Any], slo_header: str | None = None, origin: str = "") -> RoutingHints:
    """The routing hints of one /v1/completions, /v1/chat/completions or /v1/responses body. A batch of prompts
    counts the tokens of all of them, and its prefix is the chain its prompts share (what a replica's cache saves
    each of them)."""
    slo_class = slo_header if slo_header is not None else body.get("slo_class")
    slo_class = slo_class if isinstance(slo_class, str) else None
    batch = prompts_of(path, body)
    if batch is not None:
        each = [_prompt_hints(p) for p in batch]
        shared = each[0].prefix
        for h in each[1:]:
            shared = shared[:matched_chunks(h.prefix, set(shared))]
        chunk = each[0].chunk_tokens if len({h.chunk_tokens for h in each}) == 1 else 0.0
        return RoutingHints(shared if chunk else (), sum(h.tokens for h in each), chunk, slo_class, origin)
    prompt = prompt_of(path, body)
    if prompt is None:
        return RoutingHints(slo_class=slo_class, origin=origin)
    return replace(_prompt_hints(prompt), slo_class=slo_class, origin=origin)


def _prompt_hints(prompt: str | list[int]) -> RoutingHints:
    """Prefix chain and token estimate of one prompt (text or token ids)."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
        chunks = [data[i:i + CHUNK_BYTES] for i in range(0, len(data) - CHUNK_BYTES + 1, CHUNK_BYTES)]
        return RoutingHints(chain_hashes(chunks), max(1, round(len(data) / BYTES_PER_TOKEN)),
                            CHUNK_BYTES / BYTES_PER_TOKEN)
    ids = [prompt[i:i + CHUNK_IDS] for i in range(0, len(prompt) - CHUNK_IDS + 1, CHUNK_IDS)]
    chunks = [b"".join(t.to_bytes(4, "little", signed=True) for t in chunk) for chunk in ids]
    return RoutingHints(chain_hashes(chunks), len(prompt), float(CHUNK_IDS))


def matched_chunks(prefix: tuple[str, ...], held: Any) -> int:
    """How many leading chunks of `prefix` a replica holding the hashes `held` has seen (the deepest match: chain
    hashes imply every shorter one)."""
    for k in range(len(prefix), 0, -1):
        if prefix[k - 1] in held:
            return k
    return 0
