"""Chat templates that rewrite earlier turns are refused: an observation's ids can only be
appended to the sampled ids when the template renders the conversation so far unchanged."""

from __future__ import annotations

import pytest

from rlframe.envs import ChatFormat, EnvError
from tests.unit.chatml_tokenizer import CHATML_TEMPLATE, build_chatml_tokenizer

# Like Qwen3's: an assistant turn before the last user turn loses its content's first part.
REWRITING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and not loop.last -%}"
    "{{- '<|im_start|>assistant\\n' + message['content'][1:] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_template_that_rewrites_earlier_turns_is_refused() -> None:
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = REWRITING_TEMPLATE
    chat = ChatFormat(tokenizer)
    with pytest.raises(EnvError, match="not append-only at the end of an assistant turn"):
        chat.observation_ids([{"role": "user", "content": "more"}], 100)


def test_template_without_the_end_of_turn_token_is_refused() -> None:
    tokenizer = build_chatml_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE.replace("<|im_end|>", "<|im_start|>")
    with pytest.raises(EnvError, match="does not close an assistant turn with '<|im_end|>'"):
        ChatFormat(tokenizer).observation_ids([{"role": "user", "content": "more"}], 100)


def test_append_only_template_gives_the_suffix_after_the_end_of_turn_token() -> None:
    chat = ChatFormat(build_chatml_tokenizer())
    ids, cut = chat.observation_ids([{"role": "user", "content": "more"}], 100)
    assert not cut
    assert (
        chat.tokenizer.decode(ids) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
    # Exactly at the limit fits; one token fewer cuts the content.
    assert chat.observation_ids([{"role": "user", "content": "more"}], len(ids)) == (ids, False)
    shorter, cut = chat.observation_ids([{"role": "user", "content": "more"}], len(ids) - 1)
    assert cut and chat.tokenizer.decode(shorter).startswith("\n<|im_start|>user\nmor<|im_end|>")


def test_observation_cache_is_memoised_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlframe.envs.chat as chat_module

    monkeypatch.setattr(chat_module, "CACHE_SIZE", 3)
    chat = ChatFormat(build_chatml_tokenizer())
    first = chat.observation_ids([{"role": "user", "content": "a"}], 100)
    chat.observation_ids([{"role": "user", "content": "b"}], 100)
    assert len(chat.cache) == 2
    # A hit returns a copy: changing it leaves the cached ids alone.
    again = chat.observation_ids([{"role": "user", "content": "a"}], 100)
    again[0].append(-1)
    assert chat.observation_ids([{"role": "user", "content": "a"}], 100) == first
    for text in "cdefg":
        chat.observation_ids([{"role": "user", "content": text}], 100)
        assert len(chat.cache) <= 3


def test_text_ids_are_memoised_bounded_and_handed_out_as_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import rlframe.envs.chat as chat_module

    monkeypatch.setattr(chat_module, "CACHE_SIZE", 3)
    chat = ChatFormat(build_chatml_tokenizer())
    text = "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    first = chat.encode_text(text)
    assert first == chat.encode(text) and text in chat.text_cache
    first.append(-1)  # the caller's list: the cached ids stay as they were
    assert chat.encode_text(text) == chat.encode(text)
    for other in "abcdefg":
        chat.encode_text(other)
        assert len(chat.text_cache) <= 3


def test_a_tokenizer_that_adds_a_bos_token_adds_none_to_prompts_or_observations() -> None:
    """Like Llama's: encoding adds a BOS by default, and the template writes its own; the
    ids must hold the template's text only, or every turn would gain a stray BOS."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = build_chatml_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    assert tokenizer("x")["input_ids"][0] == bos
    chat = ChatFormat(tokenizer)
    prompt = chat.prompt_ids([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids, _ = chat.observation_ids([{"role": "user", "content": "more"}], 100)
    assert tokenizer.decode(ids) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"


def test_contents_are_cut_to_nothing_when_only_the_template_fits() -> None:
    chat = ChatFormat(build_chatml_tokenizer())
    blank = [{"role": "tool", "content": ""}, {"role": "user", "content": ""}]
    empty, _ = chat.observation_ids(blank, 100)
    full = [{"role": "tool", "content": "abcdef"}, {"role": "user", "content": "xyz"}]
    # Room for the template's own tokens only: both contents go, the longest first.
    assert chat.observation_ids(full, len(empty)) == (empty, True)
    # One token more: the longest is cut by the excess (to nothing), then 'xyz' to 'x'.
    ids, cut = chat.observation_ids(full, len(empty) + 1)
    assert cut and chat.tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_sixteen_tool_results_are_all_cut_when_only_the_template_fits() -> None:
    chat = ChatFormat(build_chatml_tokenizer())
    blank, _ = chat.observation_ids([{"role": "tool", "content": ""}] * 16, 1000)
    results = [{"role": "tool", "content": str(i % 10)} for i in range(16)]
    # One content emptied per pass: the sixteenth pass makes it fit.
    assert chat.observation_ids(results, len(blank)) == (blank, True)
