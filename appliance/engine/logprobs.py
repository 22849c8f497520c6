"""Log-probabilities of sampled and prompt tokens, computed on the device for the rows that ask for them and read
back to the host only when the engine reports the token (one copy per batch, however many of its rows ask).

What they report is vLLM's `--logprobs-mode` (config.LOGPROBS_MODES): `raw_logprobs` (the default) the model's own
distribution, before every logits processor (penalties, biases, masks) and the temperature, but, as vLLM's, over
the tokens a constrained request's grammar allows (its mask comes first);
`processed_logprobs` the distribution the token was sampled from: after the processors, divided by the temperature
(greedy rows: by 1) and cut by top-k, top-p and min-p (a cut token's -inf reads -9999.0); the `_logits` modes the
logits themselves instead of their log-softmax. Prompt tokens pass no processor: their values are always raw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from appliance.engine.request import GREEDY_BELOW, Request, SamplingParams, TokenLogprob
from appliance.engine.sampler import cut_logits

DEFAULT_MODE = "raw_logprobs"


class LogprobBatch:
    """Device results for some rows of one batch; `get(row)` converts the whole batch to the host once."""

    def __init__(self, chosen: torch.Tensor, rank: torch.Tensor, top_ids: torch.Tensor, top_lps: torch.Tensor,
                 ids: torch.Tensor, ks: list[int], likelihood: torch.Tensor | None = None) -> None:
        """likelihood: the chosen tokens' log-probabilities where `chosen` holds logits (the `_logits` modes)."""
        self._device = (ids, chosen, rank, top_ids, top_lps) + (() if likelihood is None else (likelihood,))
        self._ks = ks
        self._host: list[list] | None = None

    def get(self, row: int) -> TokenLogprob:
        if self._host is None:
            self._host = [t.tolist() for t in self._device]
            self._device = ()
        ids, chosen, rank, top_ids, top_lps, *likelihood = self._host
        k = self._ks[row]
        return TokenLogprob(ids[row], _finite(chosen[row]), rank[row],
                            tuple((t, _finite(v)) for t, v in zip(top_ids[row][:k], top_lps[row][:k])),
                            _finite(likelihood[0][row]) if likelihood else None)

    def __len__(self) -> int:
        return len(self._ks)


def _finite(value: float) -> float:
    """A masked token's -inf (or a NaN from overflowing logits) as vLLM reports it: -9999.0 (JSON has no -inf)."""
    return value if math.isfinite(value) else -9999.0


def scale(params: SamplingParams) -> float:
    return 1.0 if params.temperature < GREEDY_BELOW else params.temperature


def logprobs_of(values: torch.Tensor, ids: torch.Tensor, mode: str, ks: list[int]) -> LogprobBatch:
    """values [R, V] (raw or processed logits, as `mode` says), the tokens whose log-probability is wanted [R] and
    how many alternatives each row wants."""
    lp = values.float()
    likelihood = None
    if mode.endswith("logprobs"):
        lp = lp.log_softmax(dim=-1)
    else:  # (what best_of ranks candidates by: a log-probability, not a logit)
        likelihood = lp.log_softmax(dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1)
    rank = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
    k = max(ks, default=0)
    if k:
        top_lps, top_ids = lp.topk(k, dim=-1)
    else:
        top_lps = top_ids = torch.empty(len(ks), 0, device=values.device)
    return LogprobBatch(chosen, rank, top_ids, top_lps, ids, ks, likelihood)


@dataclass
class Asking:
    """The rows of a batch that ask for logprobs, their index on the device, and in a raw mode their logits copied
    before the processors change the batch's in place."""

    rows: list[int]
    index: torch.Tensor
    raw: torch.Tensor | None


def asking_rows(logits: torch.Tensor, reqs: list[Request], mode: str = DEFAULT_MODE) -> Asking | None:
    """The batch's rows that ask for logprobs, taken before its processors run (None when no row asks)."""
    rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs is not None]
    if not rows:
        return None
    index = torch.tensor(rows).to(logits.device, non_blocking=True)  # (a blocking copy waits for the queue)
    return Asking(rows, index, logits[index] if mode.startswith("raw") else None)  # (indexing by a tensor copies)


def sampled_logprobs(logits: torch.Tensor, reqs: list[Request], tokens: torch.Tensor, mode: str = DEFAULT_MODE,
                     asking: Asking | None = None) -> dict[str, tuple]:
    """{request id: (batch, row)} for the rows that asked for logprobs (empty when none did). logits: the batch's
    after the processors; asking: `asking_rows` of the batch, taken before them."""
    if asking is None:
        return {}
    rows, index = asking.rows, asking.index
    if mode.startswith("raw"):
        values = asking.raw
    else:
        params = [reqs[i].sampling for i in rows]
        t = torch.tensor([scale(p) for p in params], dtype=logits.dtype).to(logits.device, non_blocking=True)
        values = cut_logits(logits[index] / t.unsqueeze(1), params)
    batch = logprobs_of(values, tokens[index], mode, [reqs[i].sampling.logprobs for i in rows])
    return {reqs[i].request_id: (batch, n) for n, i in enumerate(rows)}


def prompt_logprobs(logits: torch.Tensor, request: Request, start: int,
                    mode: str = DEFAULT_MODE) -> tuple[int, LogprobBatch] | None:
    """Log-probabilities of prompt tokens start+1.. from the logits of rows start.. of the request's prompt
    (`logits` [N, V], row i at prompt position start + i; the last prompt position predicts an output token and is
    left out), raw in every mode (logits in the `_logits` modes). Returns (first position covered, batch)."""
    prompt = request.prompt_token_ids
    n = min(logits.shape[0], len(prompt) - 1 - start)
    if n <= 0:
        return None
    targets = torch.tensor(prompt[start + 1:start + 1 + n], dtype=torch.long).to(logits.device, non_blocking=True)
    k = request.sampling.prompt_logprobs or 0
    return start + 1, logprobs_of(logits[:n], targets, mode, [k] * n)
