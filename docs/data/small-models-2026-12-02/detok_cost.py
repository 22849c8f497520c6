"""Detokenizer cost a token at the start and after ~100k tokens: the best of 5 windows of 1000 tokens at each place."""
import time
from appliance.config import EMBEDDED_MODEL_DIR
from appliance.model_zoo.tokenizer import Tokenizer
from appliance.engine.detokenizer import Detokenizer
tok = Tokenizer(EMBEDDED_MODEL_DIR)
ids = tok.encode(" the quick brown fox jumps over the lazy dog and then runs away into the forest" * 4, add_special_tokens=False)
for stop in ([], ["The end."]):
    d = Detokenizer(tok, [1, 2, 3], stop)
    res = {}
    k = 0
    for place, upto in (("start", 0), ("100k", 100000)):
        while k < upto:
            d.push(ids[k % len(ids)]); d.delta(False); k += 1
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(1000):
                d.push(ids[k % len(ids)]); d.delta(False); k += 1
            best = min(best, time.perf_counter() - t)
        res[place] = best * 1e3
    print(f"stop {stop}: {res['start']:.2f} us a token at the start, {res['100k']:.2f} after 100k tokens ({len(d.text)} chars)")
