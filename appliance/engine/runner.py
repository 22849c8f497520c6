"""ModelRunner: executes a StepPlan on the model — builds token batches and attention metadata, runs decode and
layer-range prefill forwards, keeps unfinished prefills' hidden states between steps, and samples.

It decides nothing: which requests run, over which tokens and layers, comes from the plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby

import torch

from appliance.engine.attention import AttentionBackend, AttentionMetadata, ForwardContext, forward_context
from appliance.engine.kv_cache import KVCache
from appliance.engine.request import Request
from appliance.engine.sampler import sample
from appliance.engine.scheduler import PrefillWork, StepPlan
from appliance.model_zoo.llama import DecoderForCausalLM
from appliance.model_zoo.rope import dynamic_lengths, rope_lengths


@dataclass
class _Partial:
    """A prefill chunk that has run some layers: its activations wait here for the next layer range."""

    hidden: torch.Tensor
    residual: torch.Tensor | None
    layer_end: int


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, backend: AttentionBackend) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.device = kv_cache.data.device
        self.num_layers = model.num_layers
        self._partials: dict[str, _Partial] = {}

    def release(self, request_id: str) -> None:
        """Forget a request's unfinished prefill (it was preempted or aborted)."""
        self._partials.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, requests: dict[str, Request]) -> dict[str, int]:
        """Run the plan; returns the sampled token of every request that finished a prefill or decoded."""
        logits = self.forward_logits(plan, requests)
        if not logits:
            return {}
        ids = list(logits)
        reqs = [requests[i] for i in ids]
        tokens = sample(torch.stack([logits[i] for i in ids]), [r.sampling for r in reqs],
                        [len(r.output_token_ids) for r in reqs])
        return dict(zip(ids, tokens))

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan, requests: dict[str, Request]) -> dict[str, torch.Tensor]:
        """Run the plan's forwards; fp32 next-token logits of every request that decoded or finished its prefill."""
        out: dict[str, torch.Tensor] = {}
        if plan.mixed:
            return self._mixed(plan, requests)
        if plan.decode:
            reqs = [requests[i] for i in plan.decode]
            spans = [(r.num_tokens - 1, r.num_tokens) for r in reqs]
            hidden, residual = self._run(reqs, spans, 0, self.num_layers, None)
            out.update(zip(plan.decode, self.model.compute_logits(hidden, residual)))
        for (start, end), group in groupby(plan.prefill, key=lambda w: (w.layer_start, w.layer_end)):
            out.update(self._prefill(list(group), requests, start, end))
        return out

    def _mixed(self, plan: StepPlan, requests: dict[str, Request]) -> dict[str, torch.Tensor]:
        """Decode rows and whole-model prefill chunks in one forward; logits for the decode rows and the chunks that
        end their request's prompt."""
        for w in plan.prefill:
            if (w.layer_start, w.layer_end) != (0, self.num_layers):
                raise RuntimeError(f"a mixed step runs prefills over all layers; {w.request_id} asks for "
                                   f"[{w.layer_start}, {w.layer_end})")
        dec = [requests[i] for i in plan.decode]
        pre = [requests[w.request_id] for w in plan.prefill]
        spans = [(r.num_tokens - 1, r.num_tokens) for r in dec] + [(w.token_start, w.token_end) for w in plan.prefill]
        hidden, residual = self._run(dec + pre, spans, 0, self.num_layers, None)
        ends = torch.tensor([b - a for a, b in spans]).cumsum(0) - 1
        picked = list(range(len(dec))) + [len(dec) + i for i, (w, r) in enumerate(zip(plan.prefill, pre))
                                          if w.token_end == r.num_tokens]
        if not picked:
            return {}
        rows = ends[picked].to(self.device)
        logits = self.model.compute_logits(hidden[rows], None if residual is None else residual[rows])
        ids = list(plan.decode) + [w.request_id for w in plan.prefill]
        return {ids[i]: logits[j] for j, i in enumerate(picked)}

    def _prefill(self, works: list[PrefillWork], requests: dict[str, Request], start: int,
                 end: int) -> dict[str, torch.Tensor]:
        reqs = [requests[w.request_id] for w in works]
        spans = [(w.token_start, w.token_end) for w in works]
        carried = None
        if start > 0:
            partials = [self._partials.pop(w.request_id) for w in works]
            for w, p in zip(works, partials):
                if p.layer_end != start:
                    raise RuntimeError(f"prefill of {w.request_id} resumes at layer {start} but stopped at {p.layer_end}")
            carried = (torch.cat([p.hidden for p in partials]),
                       None if partials[0].residual is None else torch.cat([p.residual for p in partials]))
        hidden, residual = self._run(reqs, spans, start, end, carried)
        sizes = [w.num_tokens for w in works]
        if end < self.num_layers:
            res_parts = residual.split(sizes) if residual is not None else [None] * len(works)
            for w, h, r in zip(works, hidden.split(sizes), res_parts):
                self._partials[w.request_id] = _Partial(h, r, end)
            return {}
        done = [i for i, (w, r) in enumerate(zip(works, reqs)) if w.token_end == r.num_tokens]
        if not done:
            return {}
        rows = (torch.tensor(sizes, device=self.device).cumsum(0) - 1)[done]
        logits = self.model.compute_logits(hidden[rows], None if residual is None else residual[rows])
        return {works[i].request_id: logits[j] for j, i in enumerate(done)}

    def _run(self, reqs: list[Request], spans: list[tuple[int, int]], start: int, end: int,
             carried: tuple[torch.Tensor, torch.Tensor | None] | None):
        """Layers [start, end) over the tokens spans[i] of each request (embedding first when start == 0)."""
        meta, positions = self._metadata(reqs, spans)
        if carried is None:
            token_ids = [t for r, (a, b) in zip(reqs, spans) for t in r.all_token_ids[a:b]]
            hidden = self.model.embed(torch.tensor(token_ids, dtype=torch.long, device=self.device))
            residual = None
        else:
            hidden, residual = carried
        lengths = None
        if self.model.config.rope.length_dependent:
            lengths = dynamic_lengths(positions, [r.num_prompt_tokens for r in reqs], meta.query_lens)
        with forward_context(ForwardContext(self.backend, meta, self.kv_cache.data)), rope_lengths(lengths):
            return self.model.forward_layers(positions, hidden, residual, start, end)

    def _metadata(self, reqs: list[Request], spans: list[tuple[int, int]]):
        page = self.kv_cache.page_size
        positions = torch.cat([torch.arange(a, b) for a, b in spans])
        slots = []
        for r, (a, b) in zip(reqs, spans):
            pos = torch.arange(a, b)
            table = torch.tensor(r.page_table.pages, dtype=torch.long)
            slots.append(table[pos // page] * page + pos % page)
        meta = AttentionMetadata(
            query_lens=[b - a for a, b in spans],
            seq_lens=[b for _, b in spans],
            block_tables=[r.page_table.pages for r in reqs],
            slot_mapping=torch.cat(slots).to(self.device),
            page_size=page,
        )
        return meta, positions.to(self.device)
