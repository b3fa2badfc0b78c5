"""One chat choice's reply as it is sent: its text, or — when the request may call tools — content and
the tool calls read out of it (``CallReader``), delta by delta as the text streams or whole.

Both read the text the same way, so a streamed reply's deltas join to the non-streamed message: the
first delta of a call carries its id, type and name, the next ones more of its arguments' JSON text;
``finish_reason`` is ``tool_calls`` when a call was made (``length`` when ``max_tokens`` cut the reply,
a call's arguments then as far as they got, as OpenAI answers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from frontend.api_guided import FunctionCall
from frontend.api_types import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    FunctionDelta,
    StreamedToolCall,
    ToolCall,
)
from frontend.generation import Outcome
from frontend.tool_reader import CallDelta, CallReader, Read, ToolFormat

Finish = Literal["stop", "length", "tool_calls"]


class ChatReply:
    def __init__(self, fmt: ToolFormat | None, call_id: Callable[[int], str]) -> None:
        self._reader = CallReader(fmt, call_id) if fmt is not None else None

    def delta(self, text: str, last: bool) -> ChatDelta | None:
        """What to send for ``text`` (``last``: the reply ended with it); None: nothing yet (held back)."""
        if self._reader is None:
            return ChatDelta(content=text)
        read = self._reader.feed(text)
        if last:
            read += self._reader.finish()
        if not read.content and not read.calls:
            return None
        calls = [_streamed(c) for c in read.calls]
        return ChatDelta(content=read.content or None, tool_calls=calls or None)

    def chunk(
        self, rid: str, created: int, model: str, text: str, outcome: Outcome, logprobs: ChatLogprobs | None = None,
        index: int = 0, last: bool | None = None,
    ) -> ChatCompletionChunk | None:  # fmt: skip
        """The chunk for one delta of this choice (``last``: it ended with it, by default whether the
        outcome has its finish reason; then the reason goes with it); None: nothing to send yet."""
        last = bool(outcome.finish_reason) if last is None else last
        delta = self.delta(text, last)
        if delta is None and logprobs is None and not last:
            return None
        why = self.reason(outcome) if last else None
        choice = ChatChunkChoice(index=index, delta=delta or ChatDelta(), finish_reason=why, logprobs=logprobs)
        return ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])

    def reason(self, outcome: Outcome) -> Finish:
        why: Finish = "length" if outcome.finish_reason == "length" else "stop"
        return "tool_calls" if self._reader is not None and self._reader.calls and why == "stop" else why

    def message(self, text: str) -> ChatResponseMessage:
        """The whole reply, read as the stream reads it."""
        if self._reader is None:
            return ChatResponseMessage(content=text)
        read = self._reader.feed(text)
        read += self._reader.finish()
        calls = _joined(read)
        return ChatResponseMessage(content=read.content or (None if calls else ""), tool_calls=calls or None)


def _streamed(c: CallDelta) -> StreamedToolCall:
    if c.name is not None:
        return StreamedToolCall(
            index=c.index, id=c.call_id, type="function", function=FunctionDelta(name=c.name, arguments=c.arguments)
        )
    return StreamedToolCall(index=c.index, function=FunctionDelta(arguments=c.arguments))


def _joined(read: Read) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for c in read.calls:
        if c.name is not None:
            calls.append(ToolCall(id=c.call_id or "", function=FunctionCall(name=c.name, arguments=c.arguments)))
        else:
            calls[c.index].function.arguments += c.arguments
    return calls
