"""An in-process replay's engine recovers from a failed step as `muxd serve`'s does (tests/server/
test_engine_failure.py): the step's request ends with its error, the engine is rebuilt around the same weights,
and the requests after it are served; before, every later request of the replay failed behind a dead engine. With
--save-steps the step log follows the rebuilt engine."""
from __future__ import annotations

from appliance.bench.run import BenchOptions, Session
from appliance.workload.traces import RequestSpec

FAULTY = 7  # a prompt of this token fails the engine step that holds it


def test_an_in_process_engine_is_rebuilt_after_a_failed_step(llama_checkpoint):
    path, _ = llama_checkpoint
    with Session(BenchOptions(model=str(path), in_process=True, save_steps=True), "mux") as session:
        first = session.engine.engine
        step = first.step

        def faulty_step():
            if any(r.prompt_token_ids[0] == FAULTY for r in first.scheduler.requests.values()):
                raise RuntimeError("injected device fault")
            return step()

        first.step = faulty_step
        specs = [RequestSpec(0.0, 8, 4), RequestSpec(0.2, 8, 4), RequestSpec(2.0, 8, 4)]
        result = session.replay(specs, [[5] * 8, [FAULTY] * 8, [6] * 8])
        ok, failed, after = result.timelines
        assert ok.success and after.success and len(after.token_times) == 4
        assert not failed.success and "injected device fault" in failed.error
        assert session.engine.engine is not first and session.engine.restart_count == 1
        assert session.engine.engine.model is first.model
        assert any(note.startswith("1 request failed: ") for note in result.notes), result.notes
        assert any(note.startswith("the engine failed 1 time during this replay and was rebuilt") for note in
                   result.notes), result.notes
        pool = session.engine.engine.pool
        assert pool.num_free_pages == pool.num_pages
        prefilled = [rid for row in session._steps.steps for rid in row["prefill_ids"]]
        assert "trace-0" in prefilled and "trace-2" in prefilled  # logged before the failure and after the rebuild
        assert session.engine.on_rebuilt is None  # (the replay's log is detached)
