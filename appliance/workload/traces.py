"""Request traces on disk -> a list of `RequestSpec`, one small loader per public format.

Stable API (the simulator and other tools import it): `RequestSpec`, `load_trace(path, fmt="auto")`, the loaders
`load_azure`, `load_mooncake`, `load_burstgpt`, `load_sharegpt`, `FORMATS`, `detect_format`. A malformed file raises
ConfigError naming the file and the line.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from appliance.errors import ConfigError

MOONCAKE_BLOCK = 512  # tokens named by one Mooncake hash id


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    arrival:     seconds after the start of the replay at which the request is sent.
    prompt_len:  prompt tokens (exact when the prompt is synthesised; for a recorded `prompt` text, the count of the
                 tokenizer used to load it, or an estimate without one).
    output_len:  tokens to generate (forced with ignore_eos + max_tokens).
    prompt:      recorded prompt text, when the trace has one (ShareGPT); None means "synthesise prompt_len tokens".
    hash_ids:    prefix blocks (Mooncake): block i of the prompt is identified by hash_ids[i]; equal ids mean equal
                 token blocks, so two requests sharing a hash-id prefix share that prompt prefix.
    block_size:  tokens per hash-id block (the last block may be partial); 0 when there are no hash ids.
    """

    arrival: float
    prompt_len: int
    output_len: int
    prompt: str | None = None
    hash_ids: tuple[int, ...] = ()
    block_size: int = 0


FORMATS = ("azure", "mooncake", "burstgpt", "sharegpt")


def detect_format(path: str | Path) -> str:
    """Guess the format from the file's first bytes (CSV header, JSON lines or a JSON array)."""
    path = Path(path)
    with _open(path) as f:
        head = f.read(4096)
    first = head.lstrip()[:1]
    line = head.splitlines()[0] if head else ""
    if first == "[":
        return "sharegpt"
    if first == "{":
        return "mooncake"
    columns = {c.strip() for c in line.split(",")}
    if columns & {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}:
        return "azure"
    if columns & {"Request tokens", "Response tokens"}:
        return "burstgpt"
    raise ConfigError(f"{path}: cannot tell the trace format from its first line {line[:80]!r}; pass --trace-format "
                      f"with one of {', '.join(FORMATS)}")


def load_trace(path: str | Path, fmt: str = "auto", *,
               count_tokens: Callable[[str], int] | None = None) -> list[RequestSpec]:
    """Load a trace file; `fmt` is one of FORMATS or "auto". Requests come sorted by arrival, the first at 0 s.

    `count_tokens` measures recorded texts (ShareGPT); without it their length is estimated at 4 bytes per token.
    """
    path = Path(path)
    if fmt == "auto":
        fmt = detect_format(path)
    if fmt == "azure":
        return load_azure(path)
    if fmt == "mooncake":
        return load_mooncake(path)
    if fmt == "burstgpt":
        return load_burstgpt(path)
    if fmt == "sharegpt":
        return load_sharegpt(path, count_tokens)
    raise ConfigError(f"trace format {fmt!r} is unknown; choose one of auto, {', '.join(FORMATS)}")


# ---- loaders ----------------------------------------------------------------------------------------------------
def load_azure(path: str | Path) -> list[RequestSpec]:
    """Azure LLM inference trace, 2023 (Splitwise) and 2024 (DynamoLLM) releases:
    `TIMESTAMP,ContextTokens,GeneratedTokens` with wall-clock timestamps (2023: naive, 7 fractional digits;
    2024: with a UTC offset)."""
    path = Path(path)
    rows: list[tuple[int, int, int]] = []
    for line, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        ns = _timestamp_ns(row["TIMESTAMP"], path, line)
        rows.append((ns, _count(row, "ContextTokens", path, line, 1), _count(row, "GeneratedTokens", path, line, 1)))
    # differences in integer nanoseconds first: epoch seconds as floats would blur the sub-microsecond digits
    t0 = min((ns for ns, _, _ in rows), default=0)
    return _specs(path, [((ns - t0) / 1e9, p, o) for ns, p, o in rows])


def load_burstgpt(path: str | Path) -> list[RequestSpec]:
    """BurstGPT: `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type[,...]`, seconds.

    Rows with 0 response tokens are requests that failed in production (BurstGPT keeps them); they are left out,
    as the `BurstGPT_without_fails` release does, since a replay cannot ask for zero output tokens."""
    path = Path(path)
    out: list[tuple[float, int, int]] = []
    for line, row in _csv_rows(path, ("Timestamp", "Request tokens", "Response tokens")):
        t = _number(row["Timestamp"], "Timestamp", path, line)
        prompt = _count(row, "Request tokens", path, line, 0)
        output = _count(row, "Response tokens", path, line, 0)
        if prompt > 0 and output > 0:
            out.append((t, prompt, output))
    return _specs(path, out)


def load_mooncake(path: str | Path) -> list[RequestSpec]:
    """Mooncake JSON lines: `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`; each hash id
    names one 512-token block of the prompt, the last block possibly partial."""
    path = Path(path)
    specs: list[RequestSpec] = []
    with _open(path) as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{line}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{line}: expected a JSON object with timestamp, input_length, "
                                  f"output_length, hash_ids; got {type(row).__name__}")
            t = _number(row.get("timestamp"), "timestamp", path, line) / 1000.0
            prompt = _count(row, "input_length", path, line, 1)
            output = _count(row, "output_length", path, line, 1)
            ids = row.get("hash_ids", [])
            if not isinstance(ids, list) or any(not isinstance(h, int) or isinstance(h, bool) for h in ids):
                raise ConfigError(f"{path}:{line}: hash_ids must be a list of integers, got {ids!r:.80}")
            if ids and not (len(ids) - 1) * MOONCAKE_BLOCK < prompt <= len(ids) * MOONCAKE_BLOCK:
                raise ConfigError(f"{path}:{line}: {len(ids)} hash_ids of {MOONCAKE_BLOCK} tokens cannot make a "
                                  f"prompt of input_length={prompt} (expected {math.ceil(prompt / MOONCAKE_BLOCK)} "
                                  "ids)")
            specs.append(RequestSpec(t, prompt, output, hash_ids=tuple(ids),
                                     block_size=MOONCAKE_BLOCK if ids else 0))
    return _normalise(path, specs)


def load_sharegpt(path: str | Path, count_tokens: Callable[[str], int] | None = None) -> list[RequestSpec]:
    """ShareGPT JSON: `[{"id", "conversations": [{"from": "human"|"gpt", "value"}, ...]}, ...]`. As in vLLM's
    benchmark, the first turn is the prompt and the second turn's length is the output length; conversations with
    fewer than two turns are skipped. The trace has no times: every request arrives at 0 until re-timed."""
    path = Path(path)
    count = count_tokens or _estimate_tokens
    specs: list[RequestSpec] = []
    for line, entry in _json_array(path):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise ConfigError(f"{path}:{line}: expected an object with a 'conversations' list, got {entry!r:.80}")
        if len(turns) < 2:
            continue
        texts = []
        for turn in turns[:2]:
            value = turn.get("value") if isinstance(turn, dict) else None
            if not isinstance(value, str):
                raise ConfigError(f"{path}:{line}: each turn must be {{'from': ..., 'value': text}}, got "
                                  f"{turn!r:.80}")
            texts.append(value)
        if not texts[0]:
            continue
        specs.append(RequestSpec(0.0, max(1, count(texts[0])), max(1, count(texts[1])), prompt=texts[0]))
    if not specs:
        raise ConfigError(f"{path}: no conversation with a prompt and a reply")
    return specs


# ---- helpers ----------------------------------------------------------------------------------------------------
def _open(path: Path):
    if not path.is_file():
        raise ConfigError(f"{path}: trace file not found")
    return path.open(encoding="utf-8", newline="")


def _csv_rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    with _open(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise ConfigError(f"{path}: the file is empty; expected a CSV header with {', '.join(required)}")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise ConfigError(f"{path}:1: the CSV header lacks {', '.join(missing)} (found {', '.join(header)})")
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise ConfigError(f"{path}:{line}: {len(row)} fields where the header has {len(header)}")
            yield line, dict(zip(header, (c.strip() for c in row)))


def _json_array(path: Path) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array with the line each starts on (json.load would lose the lines)."""
    with _open(path) as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos, line = 0, 1

    def skip(p: int) -> int:
        while p < len(text) and text[p] in " \t\r\n":
            p += 1
        return p

    def fail(p: int, what: str) -> ConfigError:
        return ConfigError(f"{path}:{text.count(chr(10), 0, p) + 1}: {what}")

    pos = skip(pos)
    if text[pos:pos + 1] != "[":
        raise fail(pos, "expected a JSON array of conversations")
    pos = skip(pos + 1)
    if text[pos:pos + 1] == "]":
        return
    counted = 0
    while True:
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
        yield line, value
        pos = skip(end)
        if text[pos:pos + 1] == ",":
            pos = skip(pos + 1)
        elif text[pos:pos + 1] == "]":
            return
        else:
            raise fail(pos, "expected ',' or ']' after an array element")


_TIMESTAMP = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$")


def _timestamp_ns(text: str, path: Path, line: int) -> int:
    """Wall-clock timestamp -> nanoseconds since the epoch; any number of fractional digits (Azure 2023 has 7)."""
    m = _TIMESTAMP.match(text)
    if not m:
        raise ConfigError(f"{path}:{line}: TIMESTAMP {text!r} is not a date-time like 2023-11-16 18:17:03.97")
    y, mo, d, h, mi, s, frac, zone = m.groups()
    try:
        dt = datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), tzinfo=timezone.utc)
    except ValueError as exc:
        raise ConfigError(f"{path}:{line}: TIMESTAMP {text!r}: {exc}") from exc
    if zone and zone != "Z":
        sign = -1 if zone[0] == "-" else 1
        hours, minutes = int(zone[1:3]), int(zone[-2:])
        dt -= sign * timedelta(hours=hours, minutes=minutes)
    return int(dt.timestamp()) * 10**9 + int((frac or "0")[:9].ljust(9, "0"))


def _number(value: Any, field: str, path: Path, line: int) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}:{line}: {field} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{path}:{line}: {field} must be a finite number >= 0, got {value!r}")
    return number


def _count(row: dict[str, Any], field: str, path: Path, line: int, minimum: int) -> int:
    value = row.get(field)
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or number < minimum:
        raise ConfigError(f"{path}:{line}: {field} must be an integer >= {minimum}, got {value!r}")
    return number


def _estimate_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8")) / 4)


def _specs(path: Path, rows: list[tuple[float, int, int]]) -> list[RequestSpec]:
    return _normalise(path, [RequestSpec(t, p, o) for t, p, o in rows])


def _normalise(path: Path, specs: list[RequestSpec]) -> list[RequestSpec]:
    """Sort by arrival (stable) and shift so the first request arrives at 0 s."""
    if not specs:
        raise ConfigError(f"{path}: the trace holds no request")
    specs.sort(key=lambda s: s.arrival)
    t0 = specs[0].arrival
    return [RequestSpec(s.arrival - t0, s.prompt_len, s.output_len, s.prompt, s.hash_ids, s.block_size)
            for s in specs]
