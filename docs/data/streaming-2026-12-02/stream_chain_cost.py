"""A streamed token's event-loop CPU in muxd's server: 64 chat streams, each a Choices over a stand-in engine stream
and OpenAIServing._sse, fed one output per stream per step for 300 steps, as the AsyncEngine dispatches them; the best
of three runs. Run from the repository root: PYTHONPATH=. python docs/data/streaming-2026-12-02/stream_chain_cost.py"""
import asyncio, time, types
from appliance.engine.request import RequestOutput
from appliance.server import protocol as p
from appliance.server.formatting import ChatFormat
from appliance.server.serving import OpenAIServing
from appliance.server.choices import Choices
from appliance.server.metrics import Metrics

S, STEPS = 64, 300
metrics = Metrics("m")
class Engine:
    def __init__(self): self.queues = {}
    async def submit(self, request):
        q = asyncio.Queue(); self.queues[request.request_id] = q
        async def gen():
            while True:
                out = await q.get(); yield out
                if out.finished: return
        return gen()
chat = p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
me = types.SimpleNamespace(stream_interval=1, force_usage=False)
tok = types.SimpleNamespace()
async def consumer(eng, i):
    req = types.SimpleNamespace(request_id=f"r{i}", continued=False)
    choices = Choices(eng, [req], metrics)
    await choices.start()
    n = 0
    async for _ in OpenAIServing._sse(me, choices, 1, ChatFormat("c", "m", tok, chat, "none"), chat, 10):
        n += 1
    return n
async def main():
    eng = Engine()
    tasks = [asyncio.ensure_future(consumer(eng, i)) for i in range(S)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    cpu = time.thread_time()
    for step in range(STEPS):
        last = step == STEPS - 1
        outs = [RequestOutput(f"r{i}", [5], " w", last, "length" if last else None, 10, 0, step + 1) for i in range(S)]
        def dispatch(outs=outs):
            for o in outs: eng.queues[o.request_id].put_nowait(o)
        loop.call_soon(dispatch)
        await asyncio.sleep(0); await asyncio.sleep(0); await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.thread_time() - cpu) / (S * STEPS)
best = min(asyncio.run(main()) for _ in range(3))
print(f"{best*1e6:.2f} us of event-loop CPU a token ({S} streams)")
