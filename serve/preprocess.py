"""Tokenization, chat-template rendering and whole-prompt detokenization for the HTTP handlers, on
worker threads: never on the event loop, so a large prompt or a slow template cannot stall other
clients, ``/health`` or streaming.

Before a text is tokenized, its length is checked against the most characters the prompt-token
limit can cover (the limit times the longest vocabulary entry, doubled for normalizers that drop
characters): a prompt that can only be too long is refused without spending CPU on it.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .chat_template import TemplateSandbox
from .errors import bad_request
from .limits import RequestLimits
from .stop_strings import stop_matcher
from .tokenizer import check_template_kwargs, longest_token_chars, render_chat_text

NORMALIZER_SLACK = 2


class Preprocessor:
    """The tokenizer's whole-prompt work for one served model, on a small thread pool."""

    def __init__(self, tokenizer: Any, limits: RequestLimits, max_model_len: int, workers: int | None = None):
        self.tokenizer, self.limits, self.max_model_len = tokenizer, limits, max_model_len
        self.max_prompt_chars = NORMALIZER_SLACK * limits.prompt_tokens(max_model_len) * longest_token_chars(tokenizer)
        self._pool = ThreadPoolExecutor(workers or min(4, max(2, os.cpu_count() or 2)),
                                        thread_name_prefix="autodeploy-preprocess")
        self._sandbox = (TemplateSandbox(limits.chat_template_timeout, self.max_prompt_chars)
                         if limits.trust_request_chat_template else None)

    async def encode(self, prompt: str | Sequence[int], add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of a text prompt (token-id prompts pass through)."""
        if not isinstance(prompt, str):
            return list(prompt)
        self._require_tokenizer(param, "send token ids as the prompt")
        self._check_chars(prompt, param)
        return await self._run(self.tokenizer.encode, prompt, add_special_tokens=add_special_tokens)

    async def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                   chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt token ids of a conversation: the model's template, or a client's in the sandbox."""
        self._require_tokenizer("messages", "use /v1/completions with token ids")
        kwargs = dict(template_kwargs or {})
        client_template = chat_template if chat_template is not None else kwargs.pop("chat_template", None)
        if client_template is not None and self._sandbox is None:
            raise bad_request("this server does not accept chat templates from clients (its operator can allow "
                              "them with --trust_request_chat_template)", "chat_template")
        try:
            if client_template is not None:
                text = await self._run(self._render_client_template, client_template, messages, add_generation_prompt,
                                       continue_final_message, tools, kwargs)
            else:
                check_template_kwargs(self.tokenizer, kwargs)
                text = await self._run(render_chat_text, self.tokenizer, messages,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools, template_kwargs=kwargs)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        self._check_chars(text, "messages")
        # the template writes the special tokens (BOS...) itself
        return await self._run(self.tokenizer.encode, text, add_special_tokens=False)

    async def prepare_stop_strings(self, stop: tuple[str, ...]) -> None:
        """Build the stop strings' automaton here (cached), so the engine's thread finds it built."""
        if stop:
            await self._run(stop_matcher, tuple(stop))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, token_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.close()

    async def _run(self, fn: Callable, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def _require_tokenizer(self, param: str, instead: str) -> None:
        if self.tokenizer is None:
            raise bad_request(f"this server has no tokenizer: {instead}", param)

    def _check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise bad_request(f"the prompt has {len(text)} characters; {self.limits.prompt_tokens(self.max_model_len)} "
                              f"tokens (this server's longest prompt) cover at most {self.max_prompt_chars}", param)

    def _render_client_template(self, source: str, messages, add_generation_prompt: bool, continue_final_message: bool,
                                tools, kwargs: dict[str, Any]) -> str:
        if continue_final_message:
            raise ValueError("continue_final_message is not supported with a client's chat template")
        special = {k: v for k, v in getattr(self.tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
        variables = {**special, **kwargs, "messages": messages, "tools": tools,
                     "add_generation_prompt": add_generation_prompt}
        return self._sandbox.render(source, variables)
