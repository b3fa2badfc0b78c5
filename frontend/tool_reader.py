"""Tool calls read out of a model's text as it streams (OpenAI's ``tool_calls`` deltas).

``CallReader`` is fed the reply's text as it is detokenized and returns what may be sent now: content,
and per call a header (its index, id and name) followed by its arguments' JSON text piece by piece, as
OpenAI streams them. Text that could still become the opening of a call is held back until it cannot.
A whole reply is read by the same reader (one ``feed``, then ``finish``), so the pieces of a streamed
answer join to exactly the non-streamed one, whatever the chunking.

The formats (``ToolFormat``; ``tool_format.py`` picks one per model):

- ``JSON``: the whole reply is one ``{"name": ..., "arguments": ...}`` object (a forced call, written
  under the grammar).
- ``HERMES``: any text, with calls as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  (Qwen 2.5 / 3, Hermes 2 Pro / 3; and every template without a tool format of its own: the router
  asks for this one).
- ``LLAMA3_JSON``: a reply starting with ``{`` is calls ``{"name": ..., "parameters": ...}`` joined by
  ``;`` (Llama 3.1-3.3; their ``<|python_tag|>`` is a special token, which decoding drops).
- ``MISTRAL``: a reply starting with ``[`` is a JSON array of ``{"name": ..., "arguments": ...}``
  (``[TOOL_CALLS]``, special, is dropped by decoding; Mistral's v3 tokenizers: 7B v0.3, Nemo,
  Mixtral 8x22B — not the v11 ``name[ARGS]{...}`` form).

A call whose text is not such an object stays content (when its header was not sent yet) or ends where
it broke; a reply cut by ``max_tokens`` inside a call keeps the arguments sent so far (``length``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from frontend.text import overlap

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


class ToolFormat(enum.IntEnum):
    JSON = 0
    HERMES = 1
    LLAMA3_JSON = 2
    MISTRAL = 3


@dataclass(slots=True)
class CallDelta:
    """A piece of call ``index``: its header (``call_id`` and ``name`` set: the first piece) or more of
    its arguments' JSON text."""

    index: int
    arguments: str = ""
    call_id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Read:
    """What one ``feed`` / ``finish`` lets out."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Read) -> Read:
        self.content += other.content
        self.calls += other.calls
        return self


class _Phase(enum.IntEnum):
    OPEN = 0  # before the object's "{"
    KEY = 1  # a key or "}" next
    COLON = 2
    VALUE = 3  # a value's first character next
    IN_VALUE = 4
    AFTER = 5  # "," or "}" next
    DONE = 6
    BAD = 7  # not an object of this shape


@dataclass(slots=True)
class _CallScanner:
    """One call object's text, character by character: its name once its value is complete, its
    arguments' value as raw JSON text as it comes (a string value is decoded once complete)."""

    args_keys: tuple[str, ...]
    phase: _Phase = _Phase.OPEN
    depth: int = 0  # brackets open inside the current value
    in_str: bool = False
    esc: bool = False
    key: list[str] = field(default_factory=list)
    current: str = ""  # the key whose value is being read
    value: list[str] = field(default_factory=list)
    name: str | None = None
    args: list[str] = field(default_factory=list)  # arguments text not yet let out
    args_seen: bool = False
    raw: list[str] = field(default_factory=list)  # every character consumed (content if this was no call)

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the object's end; how many characters were consumed (fewer than
        ``len(text)`` once DONE or BAD: the rest is not this object's)."""
        for i, c in enumerate(text):
            if self.phase >= _Phase.DONE:
                return i
            self.raw.append(c)
            self._step(c)
            if self.phase is _Phase.BAD:
                self.raw.pop()
                return i
        return len(text)

    def _step(self, c: str) -> None:
        p = self.phase
        if p is _Phase.IN_VALUE:
            self._in_value(c)
        elif p is _Phase.KEY and self.in_str:
            self._string_char(c, self.key)
            if not self.in_str:
                self.current, self.phase = _loads_str("".join(self.key)), _Phase.COLON
        elif c.isspace():
            return
        elif p is _Phase.OPEN:
            self.phase = _Phase.KEY if c == "{" else _Phase.BAD
        elif p is _Phase.KEY:
            if c == '"':
                self.in_str, self.key = True, [c]
            else:
                self.phase = _Phase.DONE if c == "}" else _Phase.BAD
        elif p is _Phase.COLON:
            self.phase = _Phase.VALUE if c == ":" else _Phase.BAD
        elif p is _Phase.VALUE:
            self.value, self.phase = [], _Phase.IN_VALUE
            self._in_value(c)
        elif p is _Phase.AFTER:
            self.phase = _Phase.KEY if c == "," else _Phase.DONE if c == "}" else _Phase.BAD

    def _in_value(self, c: str) -> None:
        if self.in_str:
            self._string_char(c, self.value)
            done = not self.in_str and self.depth == 0
        elif c == '"':
            self.in_str = True
            self.value.append(c)
            done = False
        elif c in "{[":
            self.depth += 1
            self.value.append(c)
            done = False
        elif c in "}]" and self.depth > 0:
            self.depth -= 1
            self.value.append(c)
            done = self.depth == 0
        elif self.depth == 0 and (c in ",}" or c.isspace()):  # the end of a number, true, false, null
            self._end_value()
            self.phase = _Phase.AFTER
            self._step(c)
            return
        else:
            self.value.append(c)
            done = False
        if self.current in self.args_keys and self.value and self.value[0] != '"':
            self.args.append(c)  # object, array or scalar arguments: let out as they come
            self.args_seen = True
        if done:
            self._end_value()
            self.phase = _Phase.AFTER

    def _string_char(self, c: str, into: list[str]) -> None:
        into.append(c)
        if self.esc:
            self.esc = False
        elif c == "\\":
            self.esc = True
        elif c == '"':
            self.in_str = False

    def _end_value(self) -> None:
        text = "".join(self.value)
        if self.current == "name":
            try:
                name = json.loads(text)
            except json.JSONDecodeError:
                name = None
            self.name = name if isinstance(name, str) else None
        elif self.current in self.args_keys and text.startswith('"'):  # arguments sent as a JSON string
            self.args.append(_loads_str(text))
            self.args_seen = True
        elif self.current in self.args_keys and not text:
            self.args_seen = True

    def take_args(self) -> str:
        out, self.args = "".join(self.args), []
        return out


def _loads_str(text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return ""
    return value if isinstance(value, str) else ""


class _Mode(enum.IntEnum):
    START = 0  # nothing but whitespace yet (LLAMA3_JSON / MISTRAL / JSON decide on the first character)
    TEXT = 1  # content; HERMES watches for an opening
    CALL = 2  # inside a call object
    BETWEEN = 3  # after a call: its closing / a separator / the next call
    RAW = 4  # content to the end


class CallReader:
    """One reply's text in, content and call pieces out (see the module's docstring)."""

    def __init__(self, fmt: ToolFormat, call_id: Callable[[int], str]) -> None:
        self.fmt = fmt
        self._call_id = call_id
        self._mode = _Mode.TEXT if fmt is ToolFormat.HERMES else _Mode.START
        self._held = ""  # text not let out yet
        self._scanner: _CallScanner | None = None
        self._headed = False  # the current call's header went out
        self.calls = 0  # calls whose header went out

    def feed(self, text: str) -> Read:
        out = Read()
        s = self._held + text
        self._held = ""
        while s:
            s = self._advance(s, out)
        return out

    def finish(self) -> Read:
        """The end of the reply: held text goes out as content (a call that never got its header was no
        call); trailing whitespace after calls is dropped."""
        out = Read()
        sc = self._scanner
        if self._mode is _Mode.CALL and sc is not None:
            self._pieces(out, final=True)
            if not self._headed:
                self._content(out, self._opening() + "".join(sc.raw))
        elif self._held and not (self.calls and self._held.isspace()):
            self._content(out, self._held)
        self._held, self._scanner = "", None
        return out

    # -- the state machine -----------------------------------------------------------------------
    def _advance(self, s: str, out: Read) -> str:
        """Consume some of ``s`` (at least one character, or hold it all); the rest."""
        mode = self._mode
        if mode is _Mode.RAW:
            self._content(out, s)
            return ""
        if mode is _Mode.START:
            body = s.lstrip()
            if not body:
                self._held = s
                return ""
            first = {ToolFormat.LLAMA3_JSON: "{", ToolFormat.JSON: "{", ToolFormat.MISTRAL: "["}[self.fmt]
            if body[0] != first:
                self._mode = _Mode.RAW
                return s
            self._mode = _Mode.BETWEEN
            return body[1:] if self.fmt is ToolFormat.MISTRAL else body
        if mode is _Mode.TEXT:
            return self._text(s, out)
        if mode is _Mode.CALL:
            return self._call(s, out)
        return self._between(s, out)

    def _text(self, s: str, out: Read) -> str:
        """HERMES content: up to an opening (the whitespace before it dropped), holding back what could
        still become one and trailing whitespace (dropped if a call follows)."""
        at = s.find(HERMES_OPEN)
        if at >= 0:
            self._content(out, s[:at].rstrip())  # whitespace before an opening is dropped
            self._start_call()
            return s[at + len(HERMES_OPEN) :]
        keep = overlap(s, HERMES_OPEN)
        body = s[: len(s) - keep]
        stripped = body.rstrip()
        self._held = body[len(stripped) :] + s[len(s) - keep :]
        if stripped:
            self._content(out, stripped)
        return ""

    def _call(self, s: str, out: Read) -> str:
        sc = self._scanner
        assert sc is not None
        used = sc.feed(s)
        if sc.phase is _Phase.BAD:
            if self._headed:  # the call ends where it broke; the rest is content
                self._pieces(out, final=True)
                self._mode, self._scanner = _Mode.RAW, None
            else:  # it was no call: its text is content
                self._mode, self._scanner = _Mode.RAW, None
                self._content(out, self._opening() + "".join(sc.raw))
            return s[used:]
        self._pieces(out, final=sc.phase is _Phase.DONE)
        if sc.phase is _Phase.DONE:
            self._mode, self._scanner = _Mode.BETWEEN, None
            if not self._headed:  # an object without a name: no call, content to the end
                self._mode = _Mode.RAW
                self._content(out, self._opening() + "".join(sc.raw))
        return s[used:]

    def _between(self, s: str, out: Read) -> str:
        """After a call (or at the start of LLAMA3_JSON / MISTRAL / JSON calls): whitespace, the format's
        separator or closing, then the next call's opening, else content to the end."""
        body = s.lstrip()
        if not body:
            self._held = s
            return ""
        if self.fmt is ToolFormat.HERMES:
            if body.startswith(HERMES_CLOSE):
                self._mode = _Mode.TEXT
                return body[len(HERMES_CLOSE) :]
            if HERMES_CLOSE.startswith(body):
                self._held = s
                return ""
        elif self.fmt is ToolFormat.MISTRAL and body[0] in ",]":
            if body[0] == "]":
                self._mode = _Mode.RAW
                return body[1:].lstrip()
            return body[1:]
        elif self.fmt is ToolFormat.LLAMA3_JSON and body[0] == ";":
            return body[1:]
        if body[0] == "{" and self.fmt is not ToolFormat.HERMES and not (self.fmt is ToolFormat.JSON and self.calls):
            self._start_call()
            return body
        self._mode = _Mode.RAW
        return body

    # -- pieces ----------------------------------------------------------------------------------
    def _start_call(self) -> None:
        keys = ("parameters", "arguments") if self.fmt is ToolFormat.LLAMA3_JSON else ("arguments",)
        self._scanner, self._headed, self._mode = _CallScanner(keys), False, _Mode.CALL

    def _pieces(self, out: Read, final: bool) -> None:
        """The current call's header once its name is known, then its arguments so far (a call with no
        arguments gets "{}" at its end)."""
        sc = self._scanner
        assert sc is not None
        if not self._headed and sc.name is not None:
            self._headed = True
            out.calls.append(CallDelta(self.calls, call_id=self._call_id(self.calls), name=sc.name))
            self.calls += 1
        if not self._headed:
            return
        args = sc.take_args()
        if final and sc.phase is _Phase.DONE and not sc.args_seen:
            args += "{}"
        if args:
            out.calls.append(CallDelta(self.calls - 1, arguments=args))

    def _opening(self) -> str:
        return HERMES_OPEN if self.fmt is ToolFormat.HERMES else ""

    def _content(self, out: Read, text: str) -> None:
        out.content += text
