"""Log-probabilities of sampled and prompt tokens, computed on the device for the rows that ask for them and read
back to the host only when the engine reports the token (one copy per batch, however many of its rows ask).

The distribution is the one the token was sampled from: the logits after penalties, biases and masks, divided by
the temperature (greedy rows: by 1); top-k, top-p and min-p cuts are not applied, so alternatives keep finite values.
"""
from __future__ import annotations

import math

import torch

from appliance.engine.request import GREEDY_BELOW, Request, SamplingParams, TokenLogprob


class LogprobBatch:
    """Device results for some rows of one batch; `get(row)` converts the whole batch to the host once."""

    def __init__(self, chosen: torch.Tensor, rank: torch.Tensor, top_ids: torch.Tensor, top_lps: torch.Tensor,
                 ids: torch.Tensor, ks: list[int]) -> None:
        self._device = (ids, chosen, rank, top_ids, top_lps)
        self._ks = ks
        self._host: list[list] | None = None

    def get(self, row: int) -> TokenLogprob:
        if self._host is None:
            self._host = [t.tolist() for t in self._device]
            self._device = ()
        ids, chosen, rank, top_ids, top_lps = self._host
        k = self._ks[row]
        return TokenLogprob(ids[row], _finite(chosen[row]), rank[row],
                            tuple((t, _finite(v)) for t, v in zip(top_ids[row][:k], top_lps[row][:k])))

    def __len__(self) -> int:
        return len(self._ks)


def _finite(value: float) -> float:
    """A masked token's -inf (or a NaN from overflowing logits) as vLLM reports it: -9999.0 (JSON has no -inf)."""
    return value if math.isfinite(value) else -9999.0


def scale(params: SamplingParams) -> float:
    return 1.0 if params.temperature < GREEDY_BELOW else params.temperature


def logprobs_of(logits: torch.Tensor, ids: torch.Tensor, temperatures: list[float], ks: list[int]) -> LogprobBatch:
    """logits [R, V] (processed), the tokens whose log-probability is wanted [R], each row's temperature and how
    many alternatives it wants."""
    t = torch.tensor(temperatures, dtype=logits.dtype).to(logits.device, non_blocking=True)
    lp = (logits / t.unsqueeze(1)).log_softmax(dim=-1)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
    rank = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
    k = max(ks, default=0)
    if k:
        top_lps, top_ids = lp.topk(k, dim=-1)
    else:
        top_lps = top_ids = torch.empty(len(ks), 0, device=logits.device)
    return LogprobBatch(chosen, rank, top_ids, top_lps, ids, ks)


def sampled_logprobs(logits: torch.Tensor, reqs: list[Request], tokens: torch.Tensor) -> dict[str, tuple]:
    """{request id: (batch, row)} for the rows that asked for logprobs (empty when none did)."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    if not rows:
        return {}
    index = torch.tensor(rows).to(logits.device, non_blocking=True)  # (a blocking copy waits for the queue)
    batch = logprobs_of(logits[index], tokens[index], [scale(reqs[i].sampling) for i in rows],
                        [reqs[i].sampling.logprobs for i in rows])
    return {reqs[i].request_id: (batch, n) for n, i in enumerate(rows)}


def prompt_logprobs(logits: torch.Tensor, request: Request, start: int) -> tuple[int, LogprobBatch] | None:
    """Log-probabilities of prompt tokens start+1.. from the logits of rows start.. of the request's prompt
    (`logits` [N, V], row i at prompt position start + i; the last prompt position predicts an output token and is
    left out). Returns (first position covered, batch)."""
    prompt = request.prompt_token_ids
    n = min(logits.shape[0], len(prompt) - 1 - start)
    if n <= 0:
        return None
    targets = torch.tensor(prompt[start + 1:start + 1 + n], dtype=torch.long).to(logits.device, non_blocking=True)
    k = request.sampling.prompt_logprobs or 0
    return start + 1, logprobs_of(logits[:n], targets, [scale(request.sampling)] * n, [k] * n)
