"""Tool calls that stream: OpenAI's `tool_calls` deltas while a call's arguments are generated.

`ToolCallStream` reads one choice's text as it grows and says what to send now: content, and per
call a first delta (`index`, `id`, `type`, `function.name`, `arguments: ""`) once its name is known,
then fragments of its `arguments` text as they arrive; the fragments of a call join into its JSON
arguments. It knows the two shapes the API produces (frontend/tools.py):

- forced (`tool_choice` required or named): the grammar makes the output one call object
  `{"name": ..., "arguments": {...}}` or a JSON array of them;
- auto: Hermes blocks `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` after the content
  (Qwen2.5's template teaches them). The content before the first block streams as content, held
  back only while its end could still become `<tool_call>`. An output that begins with a JSON
  object (Llama 3.1's calls) is held whole and parsed at its end, as without streaming.

A call whose name is no tool's is not sent (as `parse_auto` drops it). Scanning re-reads the text
of the open call on each delta (calls are small: a few hundred characters); pure Python, no I/O.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

_WS = " \t\r\n"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ARGS = ("arguments", "parameters")


@dataclass(slots=True)
class CallScan:
    """How far one call object's text has come: offsets into the scanned text (-1: not yet)."""
    name: str | None = None
    args_start: int = -1
    args_end: int = -1
    end: int = -1


def _skip_ws(t: str, i: int) -> int:
    while i < len(t) and t[i] in _WS:
        i += 1
    return i


def _string_end(t: str, i: int) -> int:
    """After the JSON string that opens at t[i] ('"'); -1 while it is open."""
    i += 1
    while i < len(t):
        if t[i] == "\\":
            i += 2
        elif t[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


def _value_end(t: str, i: int) -> int:
    """After the JSON value that starts at t[i]; -1 while it may still go on."""
    if t[i] == '"':
        return _string_end(t, i)
    if t[i] in "{[":
        depth = 0
        while i < len(t):
            c = t[i]
            if c == '"':
                i = _string_end(t, i)
                if i < 0:
                    return -1
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return -1
    j = i
    while j < len(t) and t[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(t) else -1


def scan_call(t: str, i: int) -> CallScan | None:
    """Scan the call object that starts at t[i] (after white space); None: it is no call object."""
    i = _skip_ws(t, i)
    scan = CallScan()
    if i >= len(t):
        return scan
    if t[i] != "{":
        return None
    i += 1
    while True:
        i = _skip_ws(t, i)
        if i >= len(t):
            return scan
        if t[i] == "}":
            scan.end = i + 1
            return scan
        if t[i] == ",":
            i += 1
            continue
        if t[i] != '"':
            return None
        key_end = _string_end(t, i)
        if key_end < 0:
            return scan
        key = json.loads(t[i:key_end])
        i = _skip_ws(t, key_end)
        if i >= len(t):
            return scan
        if t[i] != ":":
            return None
        i = _skip_ws(t, i + 1)
        if i >= len(t):
            return scan
        if key in _ARGS and scan.args_start < 0:
            scan.args_start = i
        end = _value_end(t, i)
        if end < 0:
            return scan
        if key == "name":
            name = json.loads(t[i:end])
            scan.name = name if isinstance(name, str) else None
        elif key in _ARGS and scan.args_end < 0:
            scan.args_end = end
        i = end


@dataclass(slots=True)
class _Call:
    index: int
    name: str
    id: str
    sent: int = 0               # characters of the arguments sent so far


class ToolCallStream:
    """One choice's tool calls as deltas (module docstring). `forced`: the grammar's shape (one
    object, or an array with `array`); else auto. `names`: the tools' names."""

    def __init__(self, names: set[str], forced: bool, array: bool = False, single: bool = False) -> None:
        self.names, self.forced, self.array, self.single = names, forced, array, single
        self.text = ""
        self.calls: list[_Call] = []
        self._content_sent = 0
        self._held_whole = False        # auto, JSON-first output: parsed at the end

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """New text → (content to send, tool_calls deltas to send)."""
        self.text += text
        if self.forced:
            return "", self._calls_from(self._forced_scans())
        return self._auto()

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def finish(self) -> str:
        """At the end: the content still held back ("" once a call was sent)."""
        if self.forced or self.calls:
            return ""
        out, self._content_sent = self.text[self._content_sent:], len(self.text)
        return out

    @property
    def held_whole(self) -> bool:
        return self._held_whole

    # ---- forced ----------------------------------------------------------------------------
    def _forced_scans(self) -> list[CallScan]:
        t = self.text
        i = _skip_ws(t, 0)
        if not self.array:
            scan = scan_call(t, i)
            return [scan] if scan is not None else []
        if i >= len(t) or t[i] != "[":
            return []
        return _scan_items(t, i + 1)

    # ---- auto (Hermes blocks) --------------------------------------------------------------
    def _auto(self) -> tuple[str, list[dict]]:
        t = self.text
        if self._held_whole or (not self.calls and t.lstrip().startswith("{")):
            self._held_whole = True
            return "", []
        first = t.find(_OPEN)
        content = ""
        if not self.calls:
            upto = first if first >= 0 else len(t) - _partial_tag(t)
            if upto > self._content_sent:
                content, self._content_sent = t[self._content_sent:upto], upto
        if first < 0:
            return content, []
        scans, i = [], first
        while i >= 0:
            scan = scan_call(t, i + len(_OPEN))
            if scan is None:
                break
            scans.append(scan)
            if scan.end < 0:
                break
            i = t.find(_OPEN, scan.end)
        return content, self._calls_from(scans)

    # ---- deltas ----------------------------------------------------------------------------
    def _calls_from(self, scans: list[CallScan]) -> list[dict]:
        deltas = []
        valid = [s for s in scans if s.name is not None and s.name in self.names and s.args_start >= 0]
        if self.single:
            valid = valid[:1]
        for k, scan in enumerate(valid):
            if k >= len(self.calls):
                call = _Call(k, scan.name, f"call_{uuid.uuid4().hex[:24]}")
                self.calls.append(call)
                deltas.append({"index": k, "id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            call = self.calls[k]
            end = scan.args_end if scan.args_end >= 0 else len(self.text)
            args = self.text[scan.args_start:end]
            if len(args) > call.sent:
                deltas.append({"index": k, "function": {"arguments": args[call.sent:]}})
                call.sent = len(args)
        return _merge(deltas)


def _scan_items(t: str, i: int) -> list[CallScan]:
    """Call objects one after another from t[i], separated by commas (a JSON array's items)."""
    out = []
    while True:
        i = _skip_ws(t, i)
        while i < len(t) and t[i] == ",":
            i = _skip_ws(t, i + 1)
        if i >= len(t) or t[i] != "{":
            return out
        scan = scan_call(t, i)
        if scan is None:
            return out
        out.append(scan)
        if scan.end < 0:
            return out
        i = scan.end


def _partial_tag(t: str) -> int:
    """How many characters at the end of `t` could begin `<tool_call>`."""
    for n in range(min(len(_OPEN) - 1, len(t)), 0, -1):
        if _OPEN.startswith(t[-n:]):
            return n
    return 0


def _merge(deltas: list[dict]) -> list[dict]:
    """One delta per call index (a call's first delta and its first fragment in one)."""
    out: dict[int, dict] = {}
    for d in deltas:
        have = out.get(d["index"])
        if have is None:
            out[d["index"]] = d
        else:
            have["function"]["arguments"] += d["function"]["arguments"]
    return list(out.values())
