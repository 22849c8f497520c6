"""The step message of a tensor-parallel engine, without processes: what the other ranks rebuild from the messages
alone is what rank 0 holds (tokens, pages, the plan and its decisions), through new tokens, grown and rebuilt page
tables, releases, a request sent again after it left and tokens still on the device."""
from __future__ import annotations

from appliance.engine.batch import placeholder, span_tokens
from appliance.engine.plan import PrefillWork, StepPlan
from appliance.engine.request import Request, SamplingParams
from appliance.engine.step_wire import IDLE, RELEASE, STEP, WireDecoder, WireEncoder


def _request(rid: str, prompt: list[int], pages: list[int], prompt_logprobs: int | None = None) -> Request:
    r = Request(rid, prompt, SamplingParams(prompt_logprobs=prompt_logprobs))
    r.page_table.pages = pages
    return r


def _same(copy: Request, r: Request) -> None:
    assert copy.prompt_token_ids == r.prompt_token_ids
    assert copy.output_token_ids == r.output_token_ids
    assert copy.page_table.pages == r.page_table.pages
    assert copy.wants_prompt_logprobs == r.wants_prompt_logprobs


def test_the_other_ranks_rebuild_every_request_from_the_messages():
    enc, dec = WireEncoder(), WireDecoder()
    a = _request("a", [5, 6, 7], [3])
    b = _request("b", list(range(40)), [7, 8, 9], prompt_logprobs=2)
    requests = {"a": a, "b": b}
    plan = StepPlan(prefill=(PrefillWork("a", 0, 3, 0, 4), PrefillWork("b", 0, 16, 0, 2)))
    step = dec.read(enc.step(plan, requests, 1, False, True, (16, None)))
    assert step.kind == STEP and step.partition == 1 and step.prefill_rows == (16, None) and step.use_graphs
    number = {rid: w.request_id for rid, w in zip("ab", step.plan.prefill)}
    assert [(w.token_start, w.token_end, w.layer_start, w.layer_end) for w in step.plan.prefill] == [
        (0, 3, 0, 4), (0, 16, 0, 2)]
    for rid in "ab":
        _same(dec.requests[number[rid]], requests[rid])

    # a decodes (its first token came from the prefill), grows a page; b continues and its table is rebuilt
    a.output_token_ids += [11, 12]
    a.page_table.pages.append(4)
    b.page_table.pages = [1, 2, 5]
    plan = StepPlan(decode=("a",), prefill=(PrefillWork("b", 16, 40, 0, 4),), mixed=True)
    step = dec.read(enc.step(plan, requests, 0, True, False, ()))
    assert step.plan.mixed and step.mixed_graphs and not step.use_graphs and not step.plan.prefill_after_decode
    assert step.plan.decode == (number["a"],)
    # a temporal step: the prefill layers run after the decode rows, in the same order on every rank
    plan = StepPlan(decode=("a",), prefill=(PrefillWork("b", 16, 40, 4, 6),), prefill_after_decode=True)
    step = dec.read(enc.step(plan, requests, 0, False, True, (None,)))
    assert step.plan.prefill_after_decode and not step.plan.mixed
    for rid in "ab":
        _same(dec.requests[number[rid]], requests[rid])

    # a leaves; when it comes back (preempted, readmitted) the other ranks get all of it again, under a new number
    gone = dec.read(enc.release(("a", "never-sent")))
    assert gone.kind == RELEASE and gone.plan.finished == (number["a"],) and number["a"] not in dec.requests
    assert enc.release(("never-sent",)) is None
    a.page_table.pages = [6, 7]
    step = dec.read(enc.step(StepPlan(prefill=(PrefillWork("a", 0, 5, 0, 4),)), requests, 0, False, True, (None,)))
    again = step.plan.prefill[0].request_id
    assert again != number["a"]
    _same(dec.requests[again], a)
    # rank 0's engine has no request left: a message that changes no request
    idle = dec.read(enc.idle())
    assert idle.kind == IDLE and idle.plan.empty and not idle.plan.finished
    _same(dec.requests[again], a)


def test_a_token_still_on_the_device_goes_as_its_row_of_the_token_buffer():
    """The overlapped loop launches a step before the host has read the token it continues from: the other ranks
    get that token's placeholder (its row of the token buffer, which rank 0's broadcast filled on every rank), and
    a step whose rows rank 0 samples after its prefill launches says so."""
    enc, dec = WireEncoder(), WireDecoder()
    r = _request("r", list(range(20)), [1, 2])
    r.output_token_ids.append(99)
    r.num_pending, r.pending_row = 1, 3
    step = dec.read(enc.step(StepPlan(decode=("r",)), {"r": r}, 0, False, True, (), hold_sampling=True))
    copy = dec.requests[step.plan.decode[0]]
    assert copy.output_token_ids == [99, placeholder(3)] and step.hold_sampling
    assert span_tokens(copy, 21, 22) == [placeholder(3)]  # what its next forward reads on the device
    step = dec.read(enc.step(StepPlan(decode=("r",)), {"r": r}, 0, False, True, ()))
    assert not step.hold_sampling


def test_a_decode_step_sends_only_what_changed():
    enc = WireEncoder()
    r = _request("r", list(range(20)), [1, 2])
    r.output_token_ids.append(99)
    first = enc.step(StepPlan(decode=("r",)), {"r": r}, 0, False, True, ())
    r.output_token_ids.append(100)
    second = enc.step(StepPlan(decode=("r",)), {"r": r}, 0, False, True, ())
    assert len(second) < len(first) // 2  # one new token, no pages, no new request
