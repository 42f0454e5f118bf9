"""Tokenizer loading, chat-template rendering and per-token strings (for log-probabilities)."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path | None, chat_template: str | None = None, trust_remote_code: bool = False) -> Any:
    """The HF tokenizer in ``path``, or None when the directory has none (token-id prompts only).

    ``chat_template`` (a file path or the template itself) replaces the tokenizer's own.
    """
    if path is None:
        return None
    path = Path(path)
    if path.is_dir() and not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if chat_template:
        template_file = Path(chat_template)
        tokenizer.chat_template = template_file.read_text() if template_file.is_file() else chat_template
    return tokenizer


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], **options: Any) -> list[int]:
    """Prompt token ids of a conversation, through the tokenizer's chat template (``options`` as
    :func:`render_chat_text`). Raises ``ValueError`` when there is no template or it rejects the messages."""
    # The template writes the special tokens (BOS...) itself.
    return tokenizer.encode(render_chat_text(tokenizer, messages, **options), add_special_tokens=False)


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation through the tokenizer's own chat template. ``template_kwargs``
    are template variables only: names of ``apply_chat_template``'s own parameters are refused."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use /v1/completions or start with --chat_template")
    check_template_kwargs(tokenizer, template_kwargs)
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors, raise_exception(...) in the template
        raise ValueError(f"cannot apply the chat template: {exc}") from exc


def check_template_kwargs(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> None:
    """``ValueError`` for a template variable that would change what ``apply_chat_template`` does
    (``tokenize``, ``return_dict``, ``chat_template``...) instead of reaching the template."""
    reserved = _apply_chat_template_parameters(type(tokenizer))
    for name in template_kwargs or {}:
        if name in reserved:
            raise ValueError(f"chat_template_kwargs may not set '{name}' (only template variables are allowed)")


@functools.lru_cache(maxsize=8)
def _apply_chat_template_parameters(tokenizer_type: type) -> frozenset[str]:
    parameters = inspect.signature(tokenizer_type.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD) - {"self"}


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry as stored (byte-level and SentencePiece forms are at
    least as long as the text they decode to): a prompt of N tokens has at most N times this many."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return max((len(t) for t in vocab), default=1)


def token_strings(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token's own text, as log-probability entries name tokens."""
    if tokenizer is None:
        return [f"token_id:{t}" for t in token_ids]
    return [tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in token_ids]
