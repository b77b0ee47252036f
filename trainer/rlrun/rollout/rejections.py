"""A rollout server's refusal of a completion request, told apart from a server fault: no retry can heal it.

vLLM answers 400 for a request it will never serve — a prompt longer than its context, a parameter it refuses
— and asking again, on that server or another, gets the same answer. Issue 47: where the server's context was
smaller than rlrun believed, every request was answered 400 "maximum context length" and retried as a server
fault, 1,879 times in 6 minutes, every group (63) abandoned, no step shipped, the run never stopped. Now a
refusal is :class:`RequestRejected` (a 4xx but 404, 408 and 429: a 404 names an adapter the server lost,
:mod:`.client`; 408 and 429 say "later"): the dispatcher fails the request at once instead of retrying it, and
a prompt refused for the context is :class:`ContextExceeded`, which ends a multi-turn episode truncated or
stops the run naming the setting (:mod:`rlrun.orchestrator.dispatcher`).

The context-length answers of vLLM 0.32 (read in its source), each a 400 ``BadRequestError`` with
``{"error": {"message": …}}``:

- ``renderers/params.py`` ``_token_len_check``: "This model's maximum context length is {X} tokens. However,
  your prompt contains {N} input tokens, which exceeds this limit even without any output tokens. Please
  reduce the length of the input prompt. (parameter=input_tokens, value={N})" — what a token-id prompt longer
  than the context gets;
- ``entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``: "Input length ({N}) exceeds model's maximum
  context length ({X})."
- ``v1/engine/input_processor.py`` ``_validate_prompt_len``: "The decoder prompt (length {N}) is longer than
  the maximum model length of {X}. …", and "The decoder prompt (length {N}) plus the number of requested
  output tokens (at least 1) is longer than the maximum model length of {X}. …" (a prompt exactly as long as
  the context).

A prompt that fits but leaves less room than ``max_tokens`` is not refused by vLLM 0.32: ``get_max_tokens``
shortens the completion to the room left, and it ends ``length``. OpenAI's wording ("This model's maximum
context length is {X} tokens. However, you requested …") matches the first pattern.
"""

from __future__ import annotations

import json
import re

from rlrun.rollout.errors import RolloutError

#: 4xx statuses that are no refusal: 404 (an adapter the server lost: the client's to handle), 408 and 429
#: (later).
NOT_REFUSALS = frozenset({404, 408, 429})
#: vLLM's context-length messages (module docstring); group 1: the server's context in tokens.
CONTEXT_MESSAGES = (
    re.compile(r"maximum context length is (\d+) tokens"),
    re.compile(r"maximum context length \((\d+)\)"),
    re.compile(r"longer than the maximum model length of (\d+)"),
)


class RequestRejected(RolloutError):
    """A rollout server refused a completion request (a 4xx but :data:`NOT_REFUSALS`): the same request gets
    the same answer anywhere, so it is never retried in place.

    Attributes:
        status: the HTTP status.
        message: the server's own message (vLLM's ``error.message``, else the body's first 300 characters).
    """

    def __init__(self, base_url: str, status: int, message: str) -> None:
        self.status, self.message = status, message
        super().__init__(f"{base_url}: completion refused with {status}: {message}")


class ContextExceeded(RequestRejected):
    """A prompt refused as longer than the server's context (vLLM's messages: module docstring).

    Attributes:
        context: the server's context in tokens, as its message says (None: it did not say).
    """

    def __init__(self, base_url: str, status: int, message: str, context: int | None) -> None:
        self.context = context
        super().__init__(base_url, status, message)


def completion_error(base_url: str, status: int, body: str) -> RolloutError:
    """The error of a completion answered ``status`` (not 200) with ``body``: :class:`ContextExceeded` for a
    context refusal, :class:`RequestRejected` for another refusal, else a :class:`RolloutError` (a server
    fault, retried)."""
    if status < 400 or status >= 500 or status in NOT_REFUSALS:
        return RolloutError(f"{base_url}: completion failed with {status}: {body[:300]}")
    message = _message(body)
    for pattern in CONTEXT_MESSAGES:
        if found := pattern.search(message):
            return ContextExceeded(base_url, status, message, int(found.group(1)))
    if "context length" in message or "maximum model length" in message:
        return ContextExceeded(base_url, status, message, None)
    return RequestRejected(base_url, status, message)


def _message(body: str) -> str:
    """vLLM's (and OpenAI's) ``{"error": {"message": …}}``, else the body's first 300 characters."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body[:300]
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"][:1000]
    return body[:300]
