from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from foveal.engine.output import IncrementalDetokenizer, OutputProcessor
from foveal.engine.plan import Logprobs
from foveal.engine.request import EngineCoreOutput
from foveal.sampling_params import SamplingParams

CORPUS = ["hello world, the quick brown fox", "stop here STOP and there", "héllo wörld"] * 20


class ByteBPE:
    """Adapter to the one-method tokenizer protocol the output side uses."""

    def __init__(self):
        self.tokenizer = Tokenizer(models.BPE())
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        self.tokenizer.train_from_iterator(CORPUS, trainer)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return ByteBPE()


def stream(processor: OutputProcessor, rid: str, token_ids: list[int], last_reason="length",
           last_stop=None):
    """Feed tokens one per step; returns (request outputs, ids to abort)."""
    results, aborts = [], []
    for i, token in enumerate(token_ids):
        last = i == len(token_ids) - 1
        output = EngineCoreOutput(rid, [token], last_reason if last else None,
                                  last_stop if last else None)
        outs, to_abort = processor.process([output])
        results += outs
        aborts += to_abort
        if outs and outs[-1].finished:
            break
    return results, aborts


def test_detokenizer_never_emits_replacement_char_for_split_multibyte(tokenizer):
    text = "héllo 日本語 🙂 ok"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # chars really are split
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.update([i]) for i in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text == detokenizer.text


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab é日語🙂ж")), max_size=20))
def test_incremental_text_equals_full_decode(tokenizer, text):
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.update([i]) for i in tokenizer.encode(text)]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


def test_stop_string_across_tokens_truncates_and_asks_abort(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams(stop=["STOP"], max_tokens=100))
    ids = tokenizer.encode("stop here STOP and there")
    outputs, aborts = stream(processor, "a", ids)
    final = outputs[-1]
    assert final.finished and final.outputs[0].text == "stop here "
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", "STOP")
    assert aborts == ["a"] and not processor.has_unfinished_requests()


def test_stop_string_included_when_asked(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["STOP"], include_stop_str_in_output=True, max_tokens=100)
    processor.add_request("a", "p", [1], params)
    outputs, _ = stream(processor, "a", tokenizer.encode("stop here STOP and there"))
    assert outputs[-1].outputs[0].text == "stop here STOP"


def test_streaming_holds_back_partial_stop_string(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams(stop=["STOP"], max_tokens=100),
                          stream_delta=True)
    outputs, _ = stream(processor, "a", [i for ch in "hello STOP" for i in tokenizer.encode(ch)])
    streamed = ""
    for output in outputs:
        streamed += output.outputs[0].text
        assert "hello ".startswith(streamed)
    assert streamed == "hello "


def test_delta_mode_sends_each_token_once(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams(max_tokens=100), stream_delta=True)
    ids = tokenizer.encode("hello world")
    outputs, _ = stream(processor, "a", ids)
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    assert "".join(o.outputs[0].text for o in outputs) == "hello world"


def test_cumulative_mode_is_default(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams(max_tokens=100))
    ids = tokenizer.encode("hello world")
    outputs, _ = stream(processor, "a", ids)
    assert outputs[-1].outputs[0].token_ids == ids
    assert outputs[-1].outputs[0].text == "hello world"
    assert outputs[-1].metrics.finished_time is not None


def test_stop_token_text_is_not_in_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams(max_tokens=100))
    stop_token = tokenizer.encode("!")[0]
    outputs, aborts = stream(processor, "a", tokenizer.encode("hello") + [stop_token],
                             last_reason="stop", last_stop=stop_token)
    completion = outputs[-1].outputs[0]
    assert completion.text == "hello" and completion.stop_reason == stop_token
    assert aborts == []


def test_logprobs_converted_to_vllm_shape(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams(max_tokens=100, logprobs=2))
    a, b = tokenizer.encode("a")[0], tokenizer.encode("b")[0]
    output = EngineCoreOutput("a", [b], None, None, [Logprobs([b, a, b], [-1.5, -0.5, -1.5], 2)])
    (request_output,), _ = processor.process([output])
    completion = request_output.outputs[0]
    assert completion.cumulative_logprob == -1.5
    assert completion.logprobs[0][b].rank == 2 and completion.logprobs[0][b].decoded_token == "b"
    assert completion.logprobs[0][a].rank == 1


def test_error_finish_carries_message(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams())
    (output,), _ = processor.process([EngineCoreOutput("a", [], "error", error="bad image")])
    assert output.finished and output.error == "bad image"
    assert output.outputs[0].finish_reason == "error"


def test_aborted_request_outputs_are_dropped(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("a", "p", [1], SamplingParams())
    processor.abort_requests(["a"])
    assert processor.process([EngineCoreOutput("a", [5])]) == ([], [])
    assert not processor.has_unfinished_requests()
