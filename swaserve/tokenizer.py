"""Tokenizer: text <-> ids, chat templates and stop ids over a HF fast tokenizer, built from an HF
directory or from GGUF metadata (converted once, then cached as tokenizer.json: loader/tokenizer_files.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# Stop a turn if the template uses them (Gemma 4 templates end turns with "<turn|>").
_TURN_ENDS = ("<end_of_turn>", "<turn|>", "<|eot_id|>", "<|im_end|>", "<|end|>")

# Gemma's chat format (as in Gemma 3's own template): a system message is folded into the first user
# turn, "assistant" is spelled "model", and the template itself writes <bos>. Used only when asked for
# (`--chat-template gemma`): a base model without a template was never trained on any chat format.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


# apply_chat_template's own arguments: a request's chat_template_kwargs cannot override them.
_RESERVED_TEMPLATE_ARGS = frozenset({"conversation", "messages", "chat_template", "add_generation_prompt", "tokenize",
                                     "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                     "return_assistant_tokens_mask", "tokenizer_kwargs", "tools", "documents"})

NO_CHAT_TEMPLATE = (
    "this model has no chat template (a base model): send a plain prompt for completion, or give a "
    "template with --chat-template FILE (`--chat-template gemma`: the built-in Gemma turn format)"
)


class Tokenizer:
    """Encodes prompts and decodes outputs for one model; owns the HF fast tokenizer (`hf`).

    Invariants: `encode(text)` adds the model's special prefix/suffix (e.g. `<bos>`) exactly once, even
    when `text` already starts with it (chat templates that write `<bos>` themselves);
    `eos_token_ids` is non-empty when the model defines an EOS and lists every id that ends a turn.
    `chat_format` "harmony" (GPT-OSS, from its config): chat goes through `swaserve.chat.harmony`, and the
    template's `<|end|>`, which closes a message inside a reply, is not a stop id.
    """

    def __init__(
        self,
        hf: PreTrainedTokenizerBase,
        chat_template: str | None,
        extra_eos_ids: list[int] | tuple[int, ...] = (),
        chat_format: str | None = None,
    ):
        self.hf = hf
        self.chat_template = chat_template
        self.chat_format = chat_format
        probe = "a"
        bare = hf.encode(probe, add_special_tokens=False)
        full = hf.encode(probe, add_special_tokens=True)
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), 0)
        self._prefix: list[int] = full[:at]  # e.g. [bos]
        self._suffix: list[int] = full[at + len(bare) :]  # e.g. [] or [eos]
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        turn_ends = self._turn_end_ids(chat_template)
        self.eos_token_ids: list[int] = list(dict.fromkeys([*eos, *extra_eos_ids, *turn_ends]))

    def _turn_end_ids(self, template: str | None) -> list[int]:
        if self.chat_format == "harmony":
            return []  # a reply ends on harmony's own stop tokens (generation_config's EOS ids)
        return [i for t in _TURN_ENDS if t in (template or "") and (i := _token_id(self.hf, t)) is not None]

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a local HF checkpoint directory (tokenizer.json / tokenizer_config.json)."""
        from transformers import AutoTokenizer

        from swaserve.loader.tokenizer_files import quiet_transformers

        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"tokenizer directory not found: {path}")
        with quiet_transformers():
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        extra: list[int] = []
        gen = path / "generation_config.json"
        if gen.is_file():
            ids = json.loads(gen.read_text()).get("eos_token_id")
            extra = [ids] if isinstance(ids, int) else list(ids or [])
        template = hf.chat_template if isinstance(hf.chat_template, str) else None
        return cls(hf, template, extra, chat_format=_chat_format(path))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """From a GGUF file's `tokenizer.*` metadata; the converted tokenizer is cached by content."""
        from swaserve.loader.default_model import cache_dir
        from swaserve.loader.gguf import read_gguf_header
        from swaserve.loader.tokenizer_files import gguf_tokenizer_entry, quiet_transformers

        keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
        meta = read_gguf_header(path, string_arrays=keys).metadata
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError(f"{path} has no tokenizer in its metadata")
        entry = gguf_tokenizer_entry(meta, cache_dir() / "tokenizers")
        info = json.loads((entry / "swaserve.json").read_text())
        with quiet_transformers():
            hf = PreTrainedTokenizerFast(tokenizer_file=str(entry / "tokenizer.json"), **info["hf_kwargs"])
        return cls(hf, info["chat_template"], info["extra_eos_ids"])

    @classmethod
    def load(cls, model: str | None) -> Tokenizer:
        """The tokenizer of what `model` names (None: the embedded model), without loading weights."""
        from swaserve.loader.resolve import resolve_model

        resolved = resolve_model(model)
        return cls.from_gguf(resolved.path) if resolved.kind == "gguf" else cls.from_hf_dir(resolved.path)

    def with_chat_template(self, template: str | None) -> Tokenizer:
        """This tokenizer with another chat template (its turn-end tokens join the stop ids)."""
        if template is None:
            return self
        if self.chat_format == "harmony":
            raise ValueError("GPT-OSS chat uses its harmony format (rendered and parsed by openai-harmony); "
                             "--chat-template does not apply to it")
        base = [i for i in self.eos_token_ids if i not in self._turn_end_ids(self.chat_template)]
        return Tokenizer(self.hf, template, base)

    # -- use -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            # TRY004 waived here and in _check_message: bad user input is a ValueError (HTTP 400)
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")  # noqa: TRY004
        ids: list[int] = self.hf.encode(text, add_special_tokens=False)
        if not add_special_tokens:
            return ids
        pre = [] if ids[: len(self._prefix)] == self._prefix else self._prefix
        return [*pre, *ids, *self._suffix]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise ValueError("token ids to decode must be a list of ints")
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation to the prompt text (which may already start with <bos>; `encode`
        does not add a second one). Content may be a str or a list of {"type": "text"} parts.
        `template_kwargs`: extra template variables (e.g. `enable_thinking`), never the rendering's own."""
        if self.chat_template is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & _RESERVED_TEMPLATE_ARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
        conversation = [_check_message(m, i) for i, m in enumerate(_check_list(messages))]
        from jinja2 import TemplateError

        try:
            text = self.hf.apply_chat_template(
                conversation, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
                tokenize=False, tools=tools, **extra,
            )  # fmt: skip
        except TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
        return str(text)


def _chat_format(path: Path) -> str | None:
    """"harmony" for a GPT-OSS checkpoint (its config's model type or architecture), else None."""
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        hf_config = json.loads(config.read_text())
    except (OSError, ValueError):
        return None  # the model loader reports a broken config; the tokenizer works without it
    archs = hf_config.get("architectures") or []
    return "harmony" if hf_config.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in archs else None


def _token_id(hf: PreTrainedTokenizerBase, token: str) -> int | None:
    # The fast backend's lookup: get_vocab() builds a 262k-entry dict just to test membership.
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return backend.token_to_id(token)  # type: ignore[no-any-return]
    return hf.get_vocab().get(token)  # a slow (sentencepiece) tokenizer from an HF directory


def load_chat_template(spec: str | None) -> str | None:
    """`--chat-template`: a Jinja file's text, or `gemma` for the built-in Gemma turn format."""
    if spec is None:
        return None
    if spec == "gemma":
        return GEMMA_CHAT_TEMPLATE
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"chat template file not found: {path}")
    return path.read_text()


def _check_list(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    return messages


_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # kept for templates that render tool turns


def _check_message(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be a dict with a string 'role'")  # noqa: TRY004
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text is supported
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            raise ValueError(f"messages[{i}].content parts must all be {{'type': 'text', 'text': str}}")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts")  # noqa: TRY004
    return {"role": m["role"], "content": content, **{k: m[k] for k in _TOOL_KEYS if m.get(k) is not None}}
