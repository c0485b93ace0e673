"""Result types of the ``base_url=`` client (``_remote_client``): the engine's field names
(``GenerationResult`` / ``Choice`` / ``StreamDelta`` / ``Usage`` / ``chat_format.ToolCall`` /
``ToolCallDelta``), so code reads a result the same whichever path made it. Plain dataclasses: nothing of
``parallm_engine``, MLX or ``openai`` is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any



@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server served from its prefix cache (0 when it does not say)
    reasoning_tokens: int = 0  # completion tokens inside the model's reasoning (completion_tokens_details)
    spec_proposed_tokens: int = 0  # speculative decoding (ParaLLM's ``usage.speculative`` extension)
    spec_accepted_tokens: int = 0
    # The request's seconds queued / prefilling / decoding (ParaLLM's ``usage.timings`` extension; 0 when the
    # server does not say).
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def timings_dict(self) -> dict:
        return {"queue_s": self.queue_s, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


@dataclass
class RemoteToolCall:
    """A tool call as the server parsed it (``chat_format.ToolCall``'s fields, plus what was sent)."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)  # {} when raw_arguments is not a JSON object
    raw_arguments: str | None = None  # the argument text as the server sent it
    error: str | None = None  # set when raw_arguments is not a JSON object


@dataclass
class RemoteToolCallDelta:
    """A piece of a streamed tool call (``chat_format.ToolCallDelta``'s fields)."""

    index: int
    id: str | None = None  # set on a call's first delta, with the name
    name: str | None = None
    arguments_delta: str = ""


@dataclass
class RemoteText:
    """A content piece of a server's stream (``chat_format.ContentDelta``'s field)."""

    text: str


@dataclass
class RemoteReasoning:
    """A reasoning piece of a server's stream (``chat_format.ReasoningDelta``'s field)."""

    reasoning: str


@dataclass
class RemoteFinish:
    """A choice's end in a server's stream (``typed_output.Finish``'s ``reason``)."""

    reason: str


@dataclass
class RemoteChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None  # OpenAI's chat logprobs {"content": [...]}, as the server sent it
    content: str | None = None  # = text: a server sends content without tool-call markup
    tool_calls: list[RemoteToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # servers send text only
    stop_reason: str | int | None = None
    reasoning: str | None = None  # the server's reasoning_content (vLLM / DeepSeek / parallm serve)
    incomplete: bool = False


@dataclass
class RemoteResult:
    """A finished request (``GenerationResult``'s fields; ``text`` etc. are the first choice's), plus
    ``model``, the name the server answered with."""

    request_id: str
    choices: list[RemoteChoice]
    usage: Usage = field(default_factory=Usage)
    model: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    system_fingerprint: str | None = None  # as the server sent it (None when it did not)

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> dict | None:
        return self.choices[0].logprobs

    @property
    def tool_calls(self) -> list[RemoteToolCall]:
        return self.choices[0].tool_calls

    @property
    def content(self) -> str | None:
        return self.choices[0].content


@dataclass
class RemoteDelta:
    """One increment of one choice (``StreamDelta``'s fields) plus ``tool_calls`` pieces and ``model``."""

    request_id: str
    index: int
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: dict | None = None  # OpenAI's chat logprobs for this delta's tokens
    tool_calls: list[RemoteToolCallDelta] = field(default_factory=list)
    model: str | None = None  # the model name the server answered with
    reasoning: str | None = None  # a piece of the server's reasoning_content (never part of ``text``)
    token_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None
    error: BaseException | None = None
    system_fingerprint: str | None = None  # as the server sent it on the stream's chunks
    # The delta as typed pieces in the engine's order (``StreamDelta.pieces``): RemoteReasoning,
    # RemoteToolCallDelta, RemoteText, RemoteFinish; the same information as the fields above.
    pieces: list = field(default_factory=list)

