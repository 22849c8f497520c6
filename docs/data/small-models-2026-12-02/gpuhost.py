"""Host work per decode step of a small model on the GPU: wall, device, and a cProfile of the engine's steps."""
import cProfile, pstats, sys, time, io
from appliance.bench import engine_bench
from appliance.config import Config

model = sys.argv[1] if len(sys.argv) > 1 else "configs/models/qwen2.5-0.5b"
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,64,256").split(",")]
out = sys.argv[3] if len(sys.argv) > 3 else "/tmp/res"
cfg = Config.flat(max_num_seqs=max(batches), max_num_batched_tokens=512, max_model_len=2048)
res = engine_bench.run(model, config=cfg, batches=tuple(batches), contexts=(1024,), prefills=((512, 0),),
                       startup_only=True)
bench = res.bench
bench.iters = 200
eng = bench.engine
for b in batches:
    row = bench.decode(b, 1024)
    print(f"b={b} wall {row.ms:.3f} device {row.device_ms:.3f} busy {row.busy_ms:.3f}", flush=True)
for b in batches:
    reqs = bench.seat(b, 1024)
    for _ in range(5):
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    for _ in range(100):
        eng.step()
    dt = time.perf_counter() - t
    prof.disable()
    bench.clear(reqs)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(45)
    st.sort_stats("cumulative").print_stats(60)
    with open(f"{out}/prof-{b}.txt", "w") as f:
        f.write(f"b={b} profiled step {dt / 100 * 1e3:.3f} ms\n" + s.getvalue())
    print(f"b={b} profiled {dt / 100 * 1e3:.3f} ms", flush=True)
