"""Fixtures the end-to-end tests share."""
from __future__ import annotations

import pytest

from foveal import LLM


@pytest.fixture()
def chat_prompts(monkeypatch) -> list[str]:
    """The prompt of every LLM.chat output, as the CLI runs it: its token ids
    decoded, so what the input processor adds (videos' transcripts) shows too."""
    prompts: list[str] = []
    original = LLM.chat

    def recording_chat(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        prompts.extend(self.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False)
                       for output in outputs)
        return outputs

    monkeypatch.setattr(LLM, "chat", recording_chat)
    return prompts
