"""A multi-megabyte chat body whose prompt must be tokenized in full (a tokenizer with no cheap length bound) does
not stall the server: /health answers and a running stream keeps streaming while it is processed."""
from __future__ import annotations

import pytest
import reliability


@pytest.fixture(scope="module")
def server(serve, tmp_path_factory):
    model = reliability.unbounded_tokenizer_model(tmp_path_factory.mktemp("unbounded") / "model")
    return serve("--model", str(model), "--max-request-bytes", "16MiB", "--kv-cache-memory", "32MiB")


def test_big_chat_body_is_tokenized_off_the_event_loop(server):
    figures = reliability.big_body(server, megabytes=2)
    assert figures["status"] == 400 and figures["error_code"] == "context_length_exceeded"
    assert figures["health_probes_during"] >= 1  # /health answered while the body was being tokenized
    assert figures["stream_events_during"] >= 1  # and the running stream went on
