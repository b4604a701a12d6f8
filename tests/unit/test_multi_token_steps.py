"""Steps that accept several tokens per request (the speculative-decoding seam):
drafts scheduled as tokens to verify, rejected drafts rolled back in the KV
manager, and stops (EOS, stop token, stop string) in the middle of a run."""
from __future__ import annotations

from foveal.engine.core import EngineCore
from foveal.engine.output import OutputProcessor
from foveal.engine.plan import ModelRunnerOutput, StepPlan
from foveal.engine.request import Request
from foveal.sampling_params import SamplingParams
from tests.unit.test_output import ByteBPE
from tests.unit.test_scheduler import make_scheduler

EOS = 2


def make_request(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 32)
    return Request(rid, prompt, [], SamplingParams(eos_token_ids=(EOS,), **params), 0.0)


def prefill(scheduler, request: Request, first_token: int) -> None:
    scheduler.add_request(request)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, ModelRunnerOutput(
        sampled_token_ids={request.request_id: [first_token]}))


def test_drafts_are_scheduled_as_tokens_to_verify():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", [10, 11, 12])
    prefill(scheduler, request, 13)
    request.spec_token_ids = [14, 15, 16]
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 4}  # the last token + 3 drafts
    assert plan.scheduled_spec_decode_tokens == {"a": [14, 15, 16]}
    assert len(scheduler.kv.block_ids("a")) == 2  # room for 3 + 4 = 7 tokens


def test_three_accepted_tokens_extend_the_request_and_keep_the_kv_exact():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", [10, 11, 12])
    prefill(scheduler, request, 13)
    request.spec_token_ids = [14, 15, 16, 17, 18]
    plan = scheduler.schedule()
    assert len(scheduler.kv.block_ids("a")) == 3  # 4 known + 5 drafts = 9 slots
    # Drafts 14 and 15 accepted, 16 rejected (the target sampled 20 instead).
    outputs = scheduler.update_from_output(plan, ModelRunnerOutput(
        sampled_token_ids={"a": [14, 15, 20]}))
    assert outputs[0].new_token_ids == [14, 15, 20]
    assert request.output_token_ids == [13, 14, 15, 20]
    assert request.num_computed_tokens == 6  # 10..15 have KV; 20 is the next input
    assert len(scheduler.kv.block_ids("a")) == 2  # the block of slot 8 was given back
    assert scheduler.stats.num_draft_tokens == 5
    assert scheduler.stats.num_draft_tokens_rejected == 3
    # The workers hear of the trimmed block in the next plan.
    plan = scheduler.schedule()
    assert plan.cached_requests[0].num_trimmed_blocks == 1
    assert plan.num_scheduled_tokens == {"a": 1}


def test_a_trimmed_block_reallocated_in_the_next_step_reaches_the_workers():
    """Rejected drafts free a trailing block, which a request scheduled earlier
    in the next step takes; the next drafts need a block again and get another
    id. The plan must say both (trim 1, the new id), or the workers' table keeps
    the freed block and the two requests write each other's KV."""
    scheduler = make_scheduler(block_size=4)
    other, request = make_request("b", [30, 31, 32]), make_request("a", [10, 11, 12])
    scheduler.add_request(other)  # runs ahead of "a" in every step
    scheduler.add_request(request)
    plan = scheduler.schedule()
    tables = {new.request_id: list(new.block_ids[0]) for new in plan.new_requests}
    scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids={"b": [33], "a": [13]}))
    for drafts, runs in (([14, 15, 16, 17], {"b": [34], "a": [20]}),  # all rejected: trim
                         ([21, 22, 23, 24], {"b": [35], "a": [21, 22, 23, 24, 25]})):
        request.spec_token_ids = drafts
        plan = scheduler.schedule()
        for data in plan.cached_requests:  # what a worker does with the plan
            table = tables[data.request_id]
            if data.num_trimmed_blocks:
                del table[-data.num_trimmed_blocks:]
            table += data.new_block_ids[0]
        for rid in ("a", "b"):
            assert tables[rid] == scheduler.kv.block_ids(rid)
        assert not set(tables["a"]) & set(tables["b"])
        scheduler.update_from_output(plan, ModelRunnerOutput(sampled_token_ids=runs))


def test_eos_in_the_middle_of_an_accepted_run_cuts_the_run():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", [10, 11, 12])
    prefill(scheduler, request, 13)
    request.spec_token_ids = [14, EOS, 16]
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, ModelRunnerOutput(
        sampled_token_ids={"a": [14, EOS, 16, 17]}))
    assert outputs[0].new_token_ids == [14, EOS]
    assert outputs[0].finish_reason == "stop"
    assert request.output_token_ids == [13, 14, EOS]
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_max_tokens_in_the_middle_of_an_accepted_run_cuts_the_run():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", [10, 11, 12], max_tokens=3)
    prefill(scheduler, request, 13)
    request.spec_token_ids = [14, 15, 16]
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, ModelRunnerOutput(
        sampled_token_ids={"a": [14, 15, 16, 17]}))
    assert outputs[0].new_token_ids == [14, 15] and outputs[0].finish_reason == "length"


def test_stop_string_in_the_middle_of_three_tokens_drops_the_tokens_after_it():
    tokenizer = ByteBPE()
    ids = [tokenizer.encode(word)[0] for word in ("hello", " STOP", " world")]
    assert tokenizer.decode(ids) == "hello STOP world"
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", None, [1], SamplingParams(stop=["STOP"], logprobs=0))
    from foveal.engine.plan import Logprobs
    from foveal.engine.request import EngineCoreOutput

    logprobs = [Logprobs([t], [-float(i + 1)], 1) for i, t in enumerate(ids)]
    outputs, to_abort = processor.process([EngineCoreOutput("a", ids, new_logprobs=logprobs)])
    completion = outputs[0].outputs[0]
    assert to_abort == ["a"] and outputs[0].finished
    assert completion.text == "hello " and completion.finish_reason == "stop"
    assert completion.stop_reason == "STOP"
    assert completion.token_ids == ids[:2]
    assert len(completion.logprobs) == 2 and completion.cumulative_logprob == -3.0


class ThreeTokenExecutor:
    """Accepts a run of three tokens per decode step, as a verifier would."""

    def __init__(self, runs: list[list[int]]):
        self.runs = iter(runs)

    def execute(self, plan: StepPlan, mm_payloads) -> ModelRunnerOutput:
        return ModelRunnerOutput(sampled_token_ids={
            rid: next(self.runs) for rid in plan.num_scheduled_tokens})


def test_engine_step_with_a_stop_string_inside_a_run_finishes_the_request():
    tokenizer = ByteBPE()
    ids = [tokenizer.encode(word)[0] for word in ("hello", " STOP", " world")]
    core = EngineCore(make_scheduler(block_size=4), ThreeTokenExecutor([ids]))
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["STOP"], max_tokens=10)
    core.add_request(Request("a", [5, 6, 7], [], params, 0.0))
    processor.add_request("a", None, [5, 6, 7], params)
    outputs, to_abort = processor.process(core.step())
    core.abort_requests(to_abort)
    assert outputs[0].outputs[0].text == "hello " and outputs[0].finished
    assert outputs[0].outputs[0].token_ids == ids[:2]
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks
