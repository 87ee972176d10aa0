"""The tokenizer type: what rlframe calls on a model's tokenizer.

A Hugging Face tokenizer (``transformers.PreTrainedTokenizerBase``) is what runs, loaded
by :func:`rlframe.run.preflight.load_tokenizer` (the driver) or by a worker. rlframe uses a
small part of it, each call in one form: one sequence in, text out of the chat template.
:class:`Tokenizer` names that part with the types of those forms, so importing this module
imports no transformers (the config and the driver stay light).

Hugging Face annotates the same methods for every form at once (``decode`` of one
sequence or of a batch: ``str | list[str]``; ``apply_chat_template`` with or without
tokenizing: text, ids or a BatchEncoding), so mypy does not take a Hugging Face tokenizer
for a :class:`Tokenizer`: :func:`as_tokenizer` is the one place that says it is one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer rlframe calls, in the forms it calls it."""

    @property
    def name_or_path(self) -> str:
        """The folder or hub id it was loaded from (the model's processor loads from it)."""
        ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def chat_template(self) -> str | dict[str, str] | None: ...

    def __call__(self, text: str, /, *, add_special_tokens: bool = True) -> Mapping[str, list[int]]:
        """One text's encoding; ``["input_ids"]`` is its ids, a list of int."""
        ...

    def decode(self, token_ids: Sequence[int], /, *, skip_special_tokens: bool = False) -> str:
        """One sequence's text."""
        ...

    def convert_tokens_to_ids(self, tokens: str, /) -> int:
        """One token's id."""
        ...

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        /,
        *,
        tokenize: Literal[False],
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The conversation rendered as text (``tokenize=False``)."""
        ...

    def save_pretrained(self, save_directory: str | os.PathLike[str], /) -> object: ...


def as_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    """A Hugging Face tokenizer as a :class:`Tokenizer`.

    mypy matches every member but three, whose Hugging Face annotations are unions over
    all the forms of the call: ``decode`` of one sequence returns a str,
    ``convert_tokens_to_ids`` of one token an int, and ``apply_chat_template`` with
    ``tokenize=False`` the rendered str (its ``conversation`` is annotated as string-valued
    dicts; content parts and tool calls are accepted too). Hence the cast.
    """
    return cast(Tokenizer, tokenizer)


def read_eos_id(tokenizer: Tokenizer) -> int:
    """The EOS token's id: the stop token of every rollout. ValueError without one."""
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no EOS token")
    return tokenizer.eos_token_id


def read_pad_id(tokenizer: Tokenizer) -> int:
    """The id that fills prompt and response grids: the pad token's, else the EOS token's
    (a tokenizer may have no pad token; padded positions are masked, so any id works)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return read_eos_id(tokenizer)
