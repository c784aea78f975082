"""Data passed between the runner and its engines.

An engine turns a `ChatRequest` (one assistant turn to generate) into a `Completion`, or raises
one of the `EngineError` classes below, whose class says what the runner does next. The samples
the runner reads are `sources.Sample`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(slots=True)
class ChatRequest:
    sample_id: str
    messages: list[dict[str, Any]]
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # e.g. chat_template_kwargs
    attempt: int = 1


@dataclass(slots=True)
class Completion:
    content: str
    reasoning: str | None  # None: the engine returned no reasoning field at all
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    endpoint: str
    model: str
    token_ids: list[int] | None = None  # generated ids, when the engine gives them
    prompt_token_ids: list[int] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_tokens: int | None = None  # from usage details, when reported


class EngineError(Exception):
    """Base of engine failures. `retryable` says whether the runner may try again."""

    retryable = False

    def __init__(self, message: str, *, status: int | None = None, endpoint: str = ""):
        super().__init__(message)
        self.status = status
        self.endpoint = endpoint

    @property
    def kind(self) -> str:
        return type(self).__name__


class TransientError(EngineError):
    """Connection refused/reset, disconnect mid-response, 5xx, 429, read timeout: retry with backoff."""

    retryable = True


class RequestRejected(EngineError):
    """4xx other than 429 (bad request, context too long): fail the sample with the server's message."""


class Engine(Protocol):
    """What the runner needs from an engine. Implementations: openai (HTTP), local (in process)."""

    name: str

    async def start(self) -> None: ...

    async def complete(self, request: ChatRequest) -> Completion: ...

    async def close(self) -> None: ...
