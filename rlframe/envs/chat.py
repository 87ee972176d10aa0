"""Token ids of prompts and observations from the tokenizer's chat template.

Token in, token out: a turn's input is the previous input + the ids the model sampled + the
observation's ids. Earlier text is never decoded and re-encoded (that drifts: a different
tokenisation of the same text changes the log-probs the trainer sees). The observation's
ids are the *suffix* the template adds for the observation messages: render a dummy
conversation that ends with an assistant turn, cut it right after its end-of-turn token
(the model's stop token, which the sampled ids end with), render it again with the
observation and the next assistant header, and tokenise what was added. Whatever the
template writes after the end-of-turn token (Qwen's newline after ``<|im_end|>``) lands in
the suffix, so the ids match what the template gives for the whole conversation.

Known quirk: templates that rewrite earlier turns (Qwen3 strips ``<think>`` blocks from
assistant turns before the last user message) are not append-only for the *model's* text;
token in, token out keeps the think blocks the model sampled, which is what it was
conditioned on while sampling. The dummy turn holds no ``<think>``, so the suffix itself is
unaffected; :meth:`ChatFormat.observation_ids` checks that the template is append-only at
the end-of-turn token and says so when it is not.

Images (a vision-language model): a message's content may be a list of parts, ``{"type":
"image", "image": <PIL image | bytes>}`` among ``{"type": "text", ...}`` ones. The template
places each image's pad; the model's processor then repeats the pad to the image's token
count (:func:`rlframe.models.images.expand_prompt`), as vLLM's processor does with the same
image, and the caller appends the images (:func:`rlframe.models.images.collect_images`) to the
row's ``images`` extra in the same order.

Tokenizers without a chat template (the tiny test model) get :data:`PLAIN_TEMPLATE`:
messages' contents back to back, each assistant turn closed by the EOS token. It renders a
prompt exactly as :func:`rlframe.data.prompts.render_prompt` joins it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rlframe.core.tokenizer import Tokenizer
from rlframe.envs.base import EnvError, Message
from rlframe.models.images import collect_images, expand_prompt, load_processor

PLAIN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
)
DUMMY_TURNS: list[Message] = [
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": "y"},
]
CACHE_SIZE = 4096


class ChatFormat:
    """Renders prompts and observation suffixes for one tokenizer and one set of tools.

    Args:
        tokenizer: a Hugging Face tokenizer.
        tools: JSON schemas passed to the template as ``tools=`` (None: no tools).
        end_of_turn: the token that closes a model turn; default the tokenizer's EOS token
            (``<|im_end|>`` for Qwen2.5/Qwen3 instruct models, ``<eos>`` for the tiny model).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        tools: list[dict[str, Any]] | None = None,
        end_of_turn: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if template else PLAIN_TEMPLATE
        self.tools = tools
        end = end_of_turn or tokenizer.eos_token
        if not end:
            raise EnvError("the tokenizer has no EOS token to close a model turn with")
        self.end_of_turn = end
        self.cache: dict[str, tuple[list[int], bool]] = {}
        self.text_cache: dict[str, list[int]] = {}

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str, images: list[bytes] | None = None) -> list[int]:
        """The ids of ``text``; with ``images`` (those its image pads stand for, in order)
        each pad expanded to its image's token count, as the model's processor expands it."""
        if images:
            try:
                processor = load_processor(self.tokenizer.name_or_path)
                return expand_prompt(processor, text, images, "the observation")
            except ValueError as e:
                raise EnvError(f"messages with images: {e}") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        """The ids of image-free ``text``, memoised: many episodes add the same text (the
        tokenizer's call costs ~130 us here, a lookup well under 1 us)."""
        ids = self.text_cache.get(text)
        if ids is None:
            if len(self.text_cache) >= CACHE_SIZE:
                self.text_cache.clear()
            ids = self.text_cache[text] = self.encode(text)
        return list(ids)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The ids of the conversation so far, ending with the assistant header; image parts
        expanded (see the module docstring)."""
        images = read_images(messages)
        return self.encode(self.render(messages, add_generation_prompt=True), images)

    def observation_ids(
        self, observation: list[Message], max_tokens: int
    ) -> tuple[list[int], bool]:
        """(ids that follow the model's end-of-turn token, whether contents were cut to fit
        ``max_tokens``). Memoised: many trajectories see the same observations."""
        key = json.dumps([max_tokens, observation], sort_keys=True, default=digest)
        if key not in self.cache:
            if len(self.cache) >= CACHE_SIZE:
                self.cache.clear()
            self.cache[key] = self.fit_observation([dict(m) for m in observation], max_tokens)
        ids, cut = self.cache[key]
        return list(ids), cut

    def image_token_id(self) -> int:
        """The token of an image pad (a vision-language model's processor has one)."""
        processor = load_processor(self.tokenizer.name_or_path)
        return int(self.tokenizer.convert_tokens_to_ids(processor.image_token))

    def suffix_ids(self, observation: list[Message]) -> list[int]:
        before = self.render(DUMMY_TURNS, add_generation_prompt=False)
        end = before.rfind(self.end_of_turn)
        if end < 0:
            raise EnvError(
                f"the chat template does not close an assistant turn with {self.end_of_turn!r} "
                "(the stop token); "
                "observations cannot be aligned to the sampled ids"
            )
        prefix = before[: end + len(self.end_of_turn)]
        after = self.render(DUMMY_TURNS + observation, add_generation_prompt=True)
        if not after.startswith(prefix):
            raise EnvError(
                "the chat template is not append-only at the end of an assistant turn (it "
                "rewrites earlier "
                f"turns when an observation follows): {prefix[-80:]!r} vs "
                f"{after[: len(prefix)][-80:]!r}"
            )
        return self.encode(after[len(prefix) :], read_images(observation))

    def fit_observation(
        self, observation: list[Message], max_tokens: int
    ) -> tuple[list[int], bool]:
        """Cut the longest text content by the excess until the suffix fits. The template's
        own tokens (role headers, end-of-turn, the next assistant header) and messages with
        content parts (images) are never cut."""
        ids = self.suffix_ids(observation)
        cut = False
        texts = [i for i, m in enumerate(observation) if not isinstance(m.get("content"), list)]
        for _ in range(16):
            if len(ids) <= max_tokens or not texts:
                break
            longest = max(texts, key=lambda i: len(str(observation[i].get("content", ""))))
            content_ids = self.encode(str(observation[longest].get("content", "")))
            if not content_ids:
                break
            keep = max(0, len(content_ids) - (len(ids) - max_tokens))
            observation[longest] = {
                **observation[longest],
                "content": self.tokenizer.decode(content_ids[:keep]),
            }
            ids, cut = self.suffix_ids(observation), True
        if len(ids) <= max_tokens:
            return ids, cut
        raise EnvError(
            f"an observation needs {len(ids)} tokens even with its contents cut, more than "
            f"agent.max_obs_tokens={max_tokens}: raise agent.max_obs_tokens"
        )


def read_images(messages: list[Message]) -> list[bytes]:
    """The encoded images of ``messages``' image parts, in order (EnvError when a part's
    image cannot be read)."""
    try:
        return collect_images(messages, "an env's message")
    except ValueError as e:
        raise EnvError(str(e)) from None


def digest(value: Any) -> str:
    """A JSON stand-in for what JSON cannot hold: an image by a hash of its bytes (a PIL
    image's text names its address, which a later image may reuse), the rest by its text."""
    if isinstance(value, bytes | bytearray):
        return hashlib.sha256(value).hexdigest()
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image
        return hashlib.sha256(value.tobytes()).hexdigest() + f"{value.size}{value.mode}"
    return str(value)
