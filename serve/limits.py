"""Request limits an operator sets (``autodeploy serve`` flags), checked in the API layer before a
request reaches the engine: each broken limit is a 400 (413 for the body) naming the limit and
its flag. The bounds of single numbers (token ids, ``top_k``, seeds...) are not here: they are what
the engine can hold, in ``autodeploy.sampling_params``, and in the request schemas.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from autodeploy.sampling_params import MAX_LOGPROBS

from .errors import bad_request

# the most any server takes (the request schema says so, and stops reading a longer list there);
# the operator's flags choose limits up to these
STOP_STRINGS_CEILING = 1024
STOP_STRING_CHARS_CEILING = 4096


class RequestLimits(BaseModel):
    """What one request may ask of the server. Every field is a ``serve`` flag of the same name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_request_body_bytes: int = Field(4 * 2**20, ge=1024, description="largest request body in bytes; "
                                        "a larger one gets 413 before it is read")
    max_prompt_tokens: int | None = Field(None, ge=1, description="longest prompt in tokens (default: the "
                                          "model's context length)")
    max_stop_strings: int = Field(32, ge=0, le=STOP_STRINGS_CEILING, description="most stop strings in one request")
    max_stop_string_chars: int = Field(256, ge=1, le=STOP_STRING_CHARS_CEILING,
                                       description="longest stop string, in characters")
    max_sequences_per_request: int = Field(1024, ge=1, description="most sequences (prompts x n) one request "
                                           "may start")
    trust_request_chat_template: bool = Field(False, description="accept chat templates sent by clients "
                                              "(rendered in a sandboxed worker process with a deadline)")
    chat_template_timeout: float = Field(1.0, gt=0, le=60, description="seconds a client's chat template may "
                                         "take to render")
    max_grammar_chars: int = Field(64 * 1024, ge=16, description="longest structured-output grammar (JSON schema, "
                                   "regex, choices, EBNF, or the schema of the tools a tool choice forces), in characters")
    grammar_compile_timeout: float = Field(10.0, gt=0, le=600, description="seconds a grammar may take to compile "
                                           "(in a worker process, killed past it; failures are cached)")
    max_logprobs: int = Field(MAX_LOGPROBS, ge=0, le=MAX_LOGPROBS, description="most log-probabilities per token a "
                              f"request may ask for (logprobs, top_logprobs, prompt_logprobs; at most {MAX_LOGPROBS})")

    def check_stop(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise bad_request(f"at most {self.max_stop_strings} stop strings are allowed, got {len(stops)} "
                              "(the server's --max_stop_strings)", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_string_chars:
            raise bad_request(f"stop strings may be at most {self.max_stop_string_chars} characters, got one of "
                              f"{longest} (the server's --max_stop_string_chars)", "stop")

    def check_logprobs(self, params) -> None:
        """``params`` (SamplingParams) asks for at most ``max_logprobs`` alternatives per token."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise bad_request(f"{name}: {value} log-probabilities per token were asked for; this server returns "
                                  f"at most {self.max_logprobs} (its --max_logprobs)", name)

    def check_sequences(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_sequences_per_request:
            raise bad_request(f"this request would start {num_prompts} x {n} = {num_prompts * n} sequences; at most "
                              f"{self.max_sequences_per_request} are allowed (the server's --max_sequences_per_request)",
                              "n")

    def check_grammar(self, spec) -> None:
        """``spec``: the request's ``StructuredOutput`` (or None)."""
        if spec is not None and len(spec.spec) > self.max_grammar_chars:
            raise bad_request(f"the structured-output grammar has {len(spec.spec)} characters; this server takes at "
                              f"most {self.max_grammar_chars} (its --max_grammar_chars)", "response_format")

    def prompt_tokens(self, max_model_len: int) -> int:
        """The longest prompt this server takes, in tokens."""
        return min(self.max_prompt_tokens or max_model_len, max_model_len)

    def check_prompt_tokens(self, num_tokens: int, max_model_len: int, param: str) -> None:
        """Only the operator's own limit; the model's context is checked with the completion length."""
        if self.max_prompt_tokens is not None and num_tokens > self.max_prompt_tokens:
            raise bad_request(f"the prompt has {num_tokens} tokens; this server takes at most "
                              f"{self.max_prompt_tokens} (its --max_prompt_tokens)", param)
