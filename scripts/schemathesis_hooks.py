"""schemathesis hooks for muxd (load with SCHEMATHESIS_HOOKS=scripts.schemathesis_hooks, from the repository root).

`positive_data_acceptance` expects every schema-valid request to succeed. Two kinds of rule cannot be written in JSON
Schema: prompt tokens + max_tokens must fit the model's context (token counts depend on the tokenizer), and some
fields must agree with each other (a tool_choice naming one of the tools, top_logprobs with logprobs), and a JSON
schema, regular expression or grammar for structured output must be one the grammar compiler can express. This check
replaces it: a schema-valid request may fail only with 400 `context_length_exceeded`, `conflicting_fields`,
`invalid_json_schema` or `invalid_grammar`, besides the statuses schemathesis itself accepts (404 unknown model,
429/503 busy, 5xx caught by `not_a_server_error`).
Its generator also checks integers against a schema's bounds as doubles, so a seed drawn a few hundred past int64's
2**63 - 1 counts as valid (both round to 2**63); a refusal of such a value is the generator's error, not muxd's.
"""
from __future__ import annotations

import json
import re

import schemathesis

ACCEPTED = {401, 403, 404, 409, 429}


@schemathesis.check
def positive_data_acceptance_or_context_length(ctx, response, case):
    meta = getattr(case, "meta", None)
    mode = getattr(getattr(meta, "generation", None), "mode", None)
    status = response.status_code
    if not getattr(mode, "is_positive", False) or status < 400 or status >= 500 or status in ACCEPTED:
        return None
    try:
        code = json.loads(response.content)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    if status == 400 and code in ("context_length_exceeded", "conflicting_fields", "invalid_json_schema",
                                  "invalid_grammar"):
        return None
    if status == 400 and _past_a_bound_only_as_integers(response.content):
        return None
    raise AssertionError(f"schema-valid request refused with {status} (code {code!r}): {response.content[:300]!r}")


def _past_a_bound_only_as_integers(content: bytes) -> bool:
    """The refusal names a bound the value passes as an integer but not as a double (beyond 2**53)."""
    match = re.search(rb"(?:less|greater) than or equal to (-?\d+) \(got (-?\d+)\)", content)
    return match is not None and int(match[1]) != int(match[2]) and float(int(match[1])) == float(int(match[2]))
