"""`bench engine`'s run on a CPU (the tiny llama; the ceilings given): the rows asked for, whatever batch sizes."""
from __future__ import annotations

from appliance.bench import engine_bench
from appliance.bench.ceilings import Ceilings
from appliance.engine.factory import build_engine


def test_batches_without_one_row_still_give_every_row(llama_checkpoint, monkeypatch):
    monkeypatch.setattr(engine_bench, "measure_ceilings", lambda gpus=1: Ceilings("cpu", 1e9, 1e9))
    monkeypatch.setattr(engine_bench, "start_engine", lambda model_dir, load_format, dtype, config: (
        build_engine(config.replace(model=model_dir, load_format=load_format)), {}))
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)  # the bench's timing fence; nothing on a CPU
    path, _ = llama_checkpoint
    result = engine_bench.run(str(path), load_format="auto", batches=(2, 3), contexts=(20,), prefills=((16, 0),),
                              iters=2)
    rows = [(r.kind, r.label) for r in result.rows]
    assert rows == [("decode", "decode b=2 ctx=20"), ("decode", "decode b=3 ctx=20"),
                    ("decode-eager", "decode b=1 ctx=20"), ("prefill", "prefill new=16 cached=0")], rows
    assert all(r.ms > 0 for r in result.rows)
    assert "graph_speedup_b1" not in result.extras  # no graph row of one sequence to compare the eager one with
