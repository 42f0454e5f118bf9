"""The offline API: ``LLM(model_dir).generate(prompts, SamplingParams(...))``, through the engine.

Exposed as ``autodeploy.LLM``. Every request goes through the same continuous-batching engine as
the server, so offline and served generation behave identically.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from autodeploy.compiled import CompiledModel
from autodeploy.sampling_params import RequestOutputKind, SamplingParams

from .engine import Engine, EngineConfig
from .outputs import OutputAccumulator, RequestOutput
from .tokenizer import load_tokenizer, render_chat

Prompt = str | Sequence[int]


class LLM:
    """Compile a checkpoint (or take a compiled model) and generate with the serving engine.

    ``model``: a checkpoint directory or a ``CompiledModel``. ``tokenizer``: a directory (default:
    the checkpoint's own), a tokenizer object, or None for token-id prompts only. Other keyword
    arguments go to :func:`autodeploy.compile`.
    """

    def __init__(
        self,
        model: str | Path | CompiledModel,
        tokenizer: Any = "auto",
        *,
        enable_prefix_caching: bool = True,
        engine_config: EngineConfig | None = None,
        **compile_options: Any,
    ):
        if not isinstance(model, CompiledModel):
            from autodeploy.compiler import compile as compile_model

            model = compile_model(model, **compile_options)
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(model.model_dir if tokenizer == "auto" else tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        config = engine_config or EngineConfig(enable_prefix_caching=enable_prefix_caching)
        self.engine = Engine(model, tokenizer, config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        token_lists = [self._encode(p) for p in _as_prompt_list(prompts)]
        params = _as_params_list(sampling_params, len(token_lists))
        return self._run(token_lists, params)

    def chat(
        self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None, **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation, rendered with the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        token_lists = [render_chat(self.tokenizer, c, template_kwargs=template_kwargs) for c in conversations]
        return self._run(token_lists, _as_params_list(sampling_params, len(token_lists)))

    def _run(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        ids = [f"llm-{next(self._ids)}" for _ in token_lists]
        results = {rid: OutputAccumulator(rid) for rid in ids}
        try:
            for rid, tokens, p in zip(ids, token_lists, params):
                # nobody reads partial results here: one report per request, when it finishes
                self.engine.add_request(rid, tokens, replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id].add(out)
        finally:  # e.g. a bad prompt after good ones, or Ctrl-C: leave no request behind
            for rid in ids:
                self.engine.abort_request(rid)
        return [results[rid].result() for rid in ids]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return list(params)
