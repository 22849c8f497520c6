"""The engine requests of one API request (one per choice) as one stream of (choice index, output).

With n > 1 and the prefix cache on, the first choice is submitted alone and the others once its first token is out:
by then its prompt's full pages are in the prefix cache, so the prompt is prefilled once. Each choice feeds the
latency metrics; closing the stream (client gone, error) aborts every choice still running.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.request import Request, RequestOutput
from appliance.server.metrics import Metrics, TokenTimer

_END = object()


class Choices:
    def __init__(self, engine: AsyncEngine, requests: list[Request], metrics: Metrics,
                 share_prefill: bool = True) -> None:
        self.engine, self.requests, self.metrics = engine, requests, metrics
        self.share_prefill = share_prefill and len(requests) > 1
        self.n = len(requests)
        self._streams: list[AsyncIterator[RequestOutput]] = []
        self._timers = [TokenTimer(metrics) for _ in requests]
        self._last: list[RequestOutput | None] = [None] * self.n
        self._tasks: list[asyncio.Task] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    async def start(self) -> None:
        """Submit the first choice (and the others unless they wait for its prefill); raises what refuses it."""
        self._streams.append(await self.engine.submit(self.requests[0]))
        if not self.share_prefill:
            await self._submit_rest()

    async def _submit_rest(self) -> None:
        try:
            for request in self.requests[len(self._streams):]:
                self._streams.append(await self.engine.submit(request))
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._merged()

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if self.share_prefill:
            first = await self._streams[0].__anext__()  # its prompt's pages are cached once this arrives
            yield self._seen(0, first)
            await self._submit_rest()
        self._tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self._streams)]
        running = len(self._tasks)
        while running:
            index, item = await self._queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
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
        self._timers[index].tokens(len(out.new_token_ids))
        if out.finished:
            self.metrics.request_done(out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens,
                                      out.num_output_tokens, self._timers[index].started)
        return index, out

    async def aclose(self) -> None:
        """Stop every choice still running (their requests are aborted and their pages freed)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()  # type: ignore[attr-defined]
