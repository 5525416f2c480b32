"""JSON for checkers: the parsed value, the line of every object key, and keys written twice.

The value comes from :func:`json.loads`; the lines from a small scanner over the same (already valid) text that
tracks objects, arrays and keys with an explicit stack, so arbitrarily deep documents cost no recursion.
Documents nested deeper than :func:`json.loads` can parse are a :class:`JsonError`, not a crash.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from planner.fileio import not_finite, oversized_int


class JsonError(ValueError):
    """Not a JSON document; ``line`` is 1-based (None when unknown)."""

    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


@dataclass
class JsonDoc:
    value: Any
    lines: dict[tuple[Any, ...], int]  # key path -> 1-based line where the key is first written
    duplicates: list[tuple[tuple[Any, ...], int, int]]  # (path, line, line of the first occurrence)

    def line(self, *path: Any) -> int | None:
        """Line of the deepest written prefix of ``path``."""
        p = tuple(path)
        while p:
            if p in self.lines:
                return self.lines[p]
            p = p[:-1]
        return None


# a string followed by a colon is a key; other strings are values (skipped); braces, brackets and commas structure
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"(\s*:)?|[{}\[\],]')


class _Refused:
    """A value the planner refuses (NaN, an integer too long), kept where it stood so its key path can be named."""

    def __init__(self, why: str):
        self.why = why


def _bounded_int(text: str) -> int | _Refused:
    why = oversized_int(text)
    return _Refused(why) if why else int(text)


def _no_constant(name: str) -> _Refused:
    return _Refused(not_finite(name))


def _first_refused(value: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], _Refused] | None:
    """The key path and reason of the first refused value in document order, else None (iterative: any depth)."""
    stack: list[tuple[tuple[Any, ...], Any]] = [(path, value)]
    while stack:
        here, v = stack.pop()
        if isinstance(v, _Refused):
            return here, v
        if isinstance(v, dict):
            stack.extend(reversed([(here + (k,), x) for k, x in v.items()]))
        elif isinstance(v, list):
            stack.extend(reversed([(here + (i,), x) for i, x in enumerate(v)]))
    return None


def parse_json(text: str) -> JsonDoc:
    """Parse ``text``, keeping each object key's line and every duplicated key. Raises JsonError, also for integers of
    more than :data:`~planner.fileio.MAX_INT_DIGITS` digits and for NaN and Infinity (not JSON, though Python's json reads them), naming
    the key that holds one."""
    try:
        value = json.loads(text, parse_int=_bounded_int, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise JsonError(f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", e.lineno) from None
    except RecursionError:
        raise JsonError("nested too deeply to parse (JSON objects and arrays inside each other thousands of levels deep)", None) from None
    lines, dups = key_lines(text)
    refused = _first_refused(value)
    if refused is not None:
        path, r = refused
        where = ".".join(map(str, path)) or "the document"
        line = next((lines[path[:k]] for k in range(len(path), 0, -1) if path[:k] in lines), None)
        raise JsonError(f"not a document the planner reads: {where} is {r.why}", line)
    return JsonDoc(value, lines, dups)


def key_lines(text: str) -> tuple[dict[tuple[Any, ...], int], list[tuple[tuple[Any, ...], int, int]]]:
    """(key path -> line, duplicates) of a valid JSON text. Array elements are path items by index."""
    starts = [m.end() for m in re.finditer("\n", text)]
    lines: dict[tuple[Any, ...], int] = {}
    dups: list[tuple[tuple[Any, ...], int, int]] = []
    dup_paths: set[tuple[Any, ...]] = set()
    # stack entries: [is_object, path of the container, last key path (objects) or element index (arrays)]
    stack: list[list[Any]] = []

    def value_path() -> tuple[Any, ...]:
        if not stack:
            return ()
        is_obj, path, last = stack[-1]
        return last if is_obj else path + (last,)

    for m in _TOKEN.finditer(text):
        tok = m.group(0)
        c = tok[0]
        if c in "{[":
            path = value_path()
            stack.append([c == "{", path, path if c == "{" else 0])
        elif c in "}]":
            stack.pop()
        elif c == ",":
            if stack and not stack[-1][0]:
                stack[-1][2] += 1
        elif m.group(1) is not None and stack and stack[-1][0]:
            key = json.loads(tok[: len(tok) - len(m.group(1))])
            path = stack[-1][1] + (key,)
            line = bisect_right(starts, m.start()) + 1
            if path in lines:
                if not any(path[:i] in dup_paths for i in range(1, len(path))):
                    dups.append((path, line, lines[path]))
                dup_paths.add(path)
            else:
                lines[path] = line
            stack[-1][2] = path
    return lines, dups
