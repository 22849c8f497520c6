"""The engine requests of one API request (one per choice, of one prompt or a batch) as one stream of (choice
index, output).

With n > 1 and the prefix cache on, each prompt's first choice is submitted alone and its others once its first
token is out: by then the prompt's full pages are in the prefix cache, so each prompt is prefilled once (the others,
admitted with the first, pass the waiting queue's limit and load shedding: Request.continued). Each choice
feeds the latency metrics, and counts the tokens the response shows (echo without generation samples a token it drops);
closing the stream (client gone, error) aborts every choice still running. `gathered` joins a stream's outputs into
fewer chunks (--stream-interval).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Iterable

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import Request, RequestOutput
from appliance.server.metrics import Metrics, TokenTimer

_END = object()


class Choices:
    """`requests` are the choices of one prompt or of a batch of prompts, `group` to a prompt (prompt p's are the
    indices p * group ...; None: one prompt); `shown`: an output as the response shows it, as the stream yields it;
    `max_tokens`: the request's max_tokens as sent (None: not sent), for the metrics; `on_done`: called with each
    choice's final output."""

    def __init__(self, engine: AsyncEngine, requests: list[Request], metrics: Metrics, share_prefill: bool = True,
                 group: int | None = None, shown: Callable[[RequestOutput], RequestOutput] = lambda out: out,
                 max_tokens: int | None = None, on_done: Callable[[RequestOutput], None] | None = None) -> None:
        self.engine, self.requests, self.metrics, self.shown = engine, requests, metrics, shown
        self.max_tokens, self.on_done = max_tokens, on_done
        self.n = len(requests)
        self.group = group or self.n
        self.share_prefill = share_prefill and self.group > 1
        if self.share_prefill:  # the others follow their first choice, admitted before them: load never refuses them
            for i in range(self.n):
                requests[i].continued = i % self.group > 0
        self._streams: dict[int, AsyncIterator[RequestOutput]] = {}
        self._timers = [TokenTimer(metrics) for _ in requests]
        self._unfinished = {p: self.group for p in range(0, self.n, self.group)}  # each prompt's running choices
        self._longest = dict.fromkeys(self._unfinished, 0)  # the most tokens one of its choices generated
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    async def start(self) -> None:
        """Submit each prompt's first choice (and the others unless they wait for its prefill); raises what refuses
        one, with every choice already submitted aborted."""
        first = range(0, self.n, self.group) if self.share_prefill else range(self.n)
        await self._submit(first)

    async def _submit(self, indices: Iterable[int]) -> list[int]:
        done = []
        try:
            for i in indices:
                self._streams[i] = await self.engine.submit(self.requests[i])
                done.append(i)
        except BaseException:
            await self.aclose()
            raise
        return done

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._merged()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self.n == 1:  # one choice: its stream as it is (no task to merge it with others, one wake-up a token less)
            async for out in self._streams[0]:
                yield self._seen(0, out)
            return
        waiting = set(self._streams) if self.share_prefill else set()  # leaders whose prompt is not yet cached
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in self._streams.items()]
        running = len(self._tasks)
        while running:
            index, item = await self._queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                if index in waiting:  # its prompt's pages are cached once this arrives: the others reuse them
                    waiting.discard(index)
                    rest = await self._submit(range(index + 1, index + self.group))
                    self._tasks += [asyncio.ensure_future(self._pump(i, self._streams[i])) for i in rest]
                    running += len(rest)
                yield self._seen(index, item)

    async def _pump(self, index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
            self._queue.put_nowait((index, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, exc))

    def _seen(self, index: int, out: RequestOutput) -> tuple[int, RequestOutput]:
        self._timers[index].tokens(len(out.new_token_ids))  # (latencies: of the engine's tokens, a dropped one too)
        out = self.shown(out)
        if out.finished:
            self.metrics.request_done(out, self._timers[index], self.max_tokens)
            if self.on_done is not None:
                self.on_done(out)
            prompt = index - index % self.group
            self._longest[prompt] = max(self._longest[prompt], out.num_output_tokens)
            self._unfinished[prompt] -= 1
            if not self._unfinished[prompt]:
                self.metrics.prompt_done(self.group, self._longest[prompt])
        return index, out

    async def aclose(self) -> None:
        """Stop every choice still running (their requests are aborted and their pages freed)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams.values():
            await stream.aclose()  # type: ignore[attr-defined]


async def gathered(outputs: AsyncIterator[tuple[int, RequestOutput]],
                   interval: int) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`outputs` with each choice's outputs gathered as vLLM's --stream-interval gathers them: a choice's first output
    at once, then one for every `interval` tokens, and its last one (with what it gathered) when it finishes."""
    held: dict[int, RequestOutput] = {}
    sent: set[int] = set()
    async for index, out in outputs:
        if index in held:
            out = held.pop(index).then(out)
        if index in sent and not out.finished and len(out.new_token_ids) < interval:
            held[index] = out
            continue
        sent.add(index)
        yield index, out
