"""What changes a batch's next-token logits before sampling: repetition, presence and frequency penalties,
`logit_bias`, `allowed_token_ids`, a think block's budget, the `min_tokens` and `bad_words` masks and a grammar's
token mask — each one batched operation over the rows that need it (the host only gathers their ids into one tensor
per kind), nothing for rows that need none.
Host data goes to the device with asynchronous copies: a blocking one would wait for every kernel queued before it,
the next step's too. The penalties read their token counts from the device (`PenaltyCounts`): a penalised row is
sampled without its output on the host, so the overlapped loop never waits to read its latest token.
"""
from __future__ import annotations

import numpy as np
import torch

from appliance.engine.grammar import apply_masks
from appliance.engine.request import Request


def process_logits(logits: torch.Tensor, reqs: list[Request], counts: list[int] | None = None,
                   grammar: bool = True, penalties: "PenaltyCounts | None" = None) -> torch.Tensor:
    """Apply every request's logits processors to its row of `logits` [B, V] in place; returns `logits`. `counts`:
    each row's output tokens before the one sampled now (default: the requests' own count); grammar=False leaves
    the grammars' masks out (applied before, `apply_grammars`: every processor keeps a masked token at -inf);
    `penalties`: the device's token counts of penalised requests (default: counted from the requests' token lists,
    which must then hold every output token)."""
    if not any(_processed(r) for r in reqs):  # (most batches: one pass over the rows, not one a processor)
        return logits
    counts = counts if counts is not None else [r.num_output_tokens for r in reqs]
    penalised = [i for i, r in enumerate(reqs) if r.sampling.penalised]
    if penalised:
        _penalise(logits, [reqs[i] for i in penalised], penalised, penalties)
    biased = [(i, t, b) for i, r in enumerate(reqs) for t, b in r.sampling.logit_bias.items()]
    if biased:
        rows, cols, values = zip(*biased)
        _index_add(logits, rows, cols, torch.tensor(values, dtype=logits.dtype))
    kept = {i: r.sampling.allowed_token_ids for i, r in enumerate(reqs) if r.sampling.allowed_token_ids is not None}
    # a think block whose budget is spent: its end, token by token (its request reads its output on the host)
    for i, r in enumerate(reqs):
        forced = r.thinking.forced(r.output_token_ids) if r.thinking is not None else None
        if forced is not None:
            kept[i] = [forced]
    if kept:
        _keep_only(logits, list(kept), list(kept.values()))
    # (output tokens still on the device count: the token sampled now is the next one)
    blocked = [(i, t) for i, r in enumerate(reqs) if counts[i] < r.sampling.min_tokens
               for t in r.min_tokens_blocked]
    # (a bad word of several tokens reads the output on the host: its request is sampled once its latest token is
    # read, Request.reads_output)
    blocked += [(i, t) for i, r in enumerate(reqs) if r.bad_words is not None
                for t in r.bad_words.banned(r.output_token_ids)]
    if blocked:
        rows, cols = zip(*blocked)
        _index_put(logits, rows, cols, float("-inf"))
    return apply_grammars(logits, reqs) if grammar else logits


def apply_grammars(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Keep each constrained request's row of `logits` to the tokens its grammar allows next (in place)."""
    # (a grammar that ended since the row was launched: the request finished, this row's token is dropped; one
    # waiting for the end of thinking masks nothing yet)
    constrained = [i for i, r in enumerate(reqs) if r.matcher is not None and r.matcher.constraining]
    if constrained:
        apply_masks(logits, [reqs[i].matcher for i in constrained], constrained)
    return logits


def _processed(r: Request) -> bool:
    """Whether any processor above may change the request's row."""
    sp = r.sampling
    return (sp.penalised or bool(sp.logit_bias) or sp.allowed_token_ids is not None or sp.min_tokens > 0
            or r.bad_words is not None or r.matcher is not None or r.thinking is not None)


def _penalise(logits: torch.Tensor, reqs: list[Request], rows: list[int],
              penalties: "PenaltyCounts | None" = None) -> None:
    """vLLM's semantics: repetition divides positive logits (multiplies negative ones) of every token seen in the
    prompt or the output; frequency subtracts penalty x count in the output; presence subtracts penalty once."""
    vocab, device = logits.shape[-1], logits.device
    index = to_device(torch.tensor(rows), device)
    sub = logits[index]
    if penalties is not None:
        slots = penalties.rows(reqs)
        counts = penalties.counts[slots].to(sub.dtype)
        prompt_seen = penalties.seen[slots]
    else:
        counts = _counts([r.output_token_ids for r in reqs], vocab, device)
        prompt_seen = None
    params = torch.tensor([(r.sampling.repetition_penalty, r.sampling.frequency_penalty,
                            r.sampling.presence_penalty) for r in reqs], dtype=logits.dtype)
    params = to_device(params, device)
    repetition, frequency, presence = (params[:, k:k + 1] for k in range(3))
    if any(r.sampling.repetition_penalty != 1.0 for r in reqs):
        if prompt_seen is None:
            prompt_seen = _prompt_seen(reqs, vocab, device)
        seen = (counts > 0) | prompt_seen
        scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, scaled, sub)
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    logits[index] = sub


def _counts(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] occurrences of each token id in each row's sequence (one padded copy to the device)."""
    width = max((len(s) for s in seqs), default=0)
    ids = np.full((len(seqs), max(width, 1)), vocab, dtype=np.int64)  # the pad id counts in a column cut off below
    for row, seq in enumerate(seqs):
        ids[row, :len(seq)] = seq
    index = to_device(torch.from_numpy(ids), device)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :vocab]


def _prompt_seen(reqs: list[Request], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, V]: the tokens of each request's prompt, where a repetition penalty reads them (else none)."""
    return _counts([r.prompt_token_ids if r.sampling.repetition_penalty != 1.0 else [] for r in reqs], vocab,
                   device) > 0


class PenaltyCounts:
    """The token counts of penalised requests on the device, a row each while they are served: the prompt's tokens
    marked (`seen`) and the output's counted (`counts`) when a request is first sampled (from the host's lists,
    complete then: its first sample, or its first after a preemption), and each token it samples counted on the
    device right after (`count`), so no later sample needs its output on the host. A row is given back when its
    request leaves or is preempted (`release`); the executor orders a launch after the step before it, so a row given
    to another request is cleared only after every count into it. The first penalised request allocates `limit`
    rows (the most one step samples: the factory reserves their memory), so that no row moves while a launch may
    still count into it; without a limit (or past it) rows grow by doubling."""

    def __init__(self, vocab: int, device: torch.device, limit: int | None = None) -> None:
        self.vocab, self.device, self.limit = vocab, device, limit
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._slot: dict[str, int] = {}
        self._free: list[int] = []

    def rows(self, reqs: list[Request]) -> torch.Tensor:
        """The requests' rows (a device tensor), filling those of requests sampled here for the first time."""
        new = [r for r in reqs if r.request_id not in self._slot]
        for r in new:
            self._slot[r.request_id] = self._take()
        if new:
            self._fill(new)
        return to_device(torch.tensor([self._slot[r.request_id] for r in reqs]), self.device)

    def count(self, reqs: list[Request], rows: list[int], tokens: torch.Tensor) -> None:
        """Count the token each request (given its row already) sampled, at `rows` of `tokens` (on the device)."""
        index = to_device(torch.tensor([[self._slot[r.request_id] for r in reqs], rows]), self.device)
        self.counts.index_put_((index[0], tokens[index[1]].to(torch.long)),
                               torch.ones(len(reqs), dtype=torch.int32, device=self.device), accumulate=True)

    def release(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def _take(self) -> int:
        if not self._free:
            n = len(self.counts)
            grown = self.limit if self.limit and n < self.limit else max(8, 2 * n)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grown - n, self.vocab)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grown - n, self.vocab)])
            self._free = list(range(grown - 1, n - 1, -1))
        return self._free.pop()

    def _fill(self, reqs: list[Request]) -> None:
        """Set the requests' rows from the host's lists: their outputs' counts and their prompts' tokens (where a
        repetition penalty reads them)."""
        index = to_device(torch.tensor([self._slot[r.request_id] for r in reqs]), self.device)
        self.counts[index] = _counts([r.output_token_ids for r in reqs], self.vocab, self.device).to(torch.int32)
        self.seen[index] = _prompt_seen(reqs, self.vocab, self.device)


def _keep_only(logits: torch.Tensor, rows: list[int], allowed: list[list[int]]) -> None:
    """-inf for every token of a row that its list does not allow."""
    ids = [(k, t) for k, tokens in enumerate(allowed) for t in tokens]
    barred = torch.ones(len(rows), logits.shape[-1], dtype=torch.bool)
    barred[[k for k, _ in ids], [t for _, t in ids]] = False
    index = to_device(torch.tensor(rows), logits.device)
    logits[index] = logits[index].masked_fill(to_device(barred, logits.device), float("-inf"))


def _index_add(logits: torch.Tensor, rows: tuple[int, ...], cols: tuple[int, ...], values: torch.Tensor) -> None:
    r, c = _coords(logits, rows, cols)
    logits.index_put_((r, c), to_device(values, logits.device), accumulate=True)


def _index_put(logits: torch.Tensor, rows: tuple[int, ...], cols: tuple[int, ...], value: float) -> None:
    r, c = _coords(logits, rows, cols)
    logits.index_put_((r, c), to_device(torch.tensor(value, dtype=logits.dtype), logits.device))


def _coords(logits: torch.Tensor, rows: tuple[int, ...], cols: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    both = to_device(torch.tensor([rows, cols], dtype=torch.long), logits.device)
    return both[0], both[1]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued there (the copy is staged at once)."""
    return host.to(device, non_blocking=True)
