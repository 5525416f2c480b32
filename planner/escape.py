"""Every user value that reaches an output goes through one function per output format.

User values (model arguments, file names, the planning command) can hold any character. Each format has its own
hazards: a shell comment ends at a line break, and Python's ``str.splitlines`` (which the drift check reads headers
with) breaks lines at eleven characters, not two; XML 1.0 forbids most control characters outright (a document with
one is not well-formed); Markdown and HTML interpret ``<``, ``&`` and punctuation. So:

* :func:`one_line`: text for a ``#`` comment or any single line read back with ``splitlines``: backslash and every
  line boundary spelled as an escape; :func:`from_one_line` is its inverse.
* :func:`xml_text`: text for an SVG/XML element or attribute: ``& < > "`` as entities, characters XML 1.0 forbids
  shown as ``\\xNN`` / ``\\uNNNN`` (never written raw).
* :func:`markdown_text`: literal Markdown inline text (safe in a table cell): HTML characters as entities, Markdown
  punctuation backslash-escaped, control characters shown as escapes.
* :func:`code_span`: a Markdown code span that survives backticks in the value (inside it nothing is interpreted).
* :func:`html_comment`: one-line text inside ``<!-- -->``.
"""

from __future__ import annotations

from typing import Any

#: the escapes one_line writes for the line boundaries of str.splitlines (and the rest of C0, DEL, C1 and the Unicode
#: separators as \\xNN / \\uNNNN)
LINE_BREAKS = {"\n": "\\n", "\r": "\\r", "\x0b": "\\v", "\x0c": "\\f"}
_UNESCAPE = {v[1:]: k for k, v in LINE_BREAKS.items()}


def _is_control(c: str) -> bool:
    n = ord(c)
    return n < 0x20 or 0x7F <= n <= 0x9F or n in (0x2028, 0x2029, 0xFFFE, 0xFFFF) or 0xD800 <= n <= 0xDFFF


def one_line(text: Any) -> str:
    """``text`` safe on one line (a ``#`` comment, a header read back with splitlines): the backslash, every line
    boundary of str.splitlines and every other control character spelled as an escape, so nothing after them becomes
    code or another line, and no terminal sequence is written raw."""
    out = []
    for c in str(text):
        if c == "\\":
            out.append("\\\\")
        elif c in LINE_BREAKS:
            out.append(LINE_BREAKS[c])
        elif c != "\t" and _is_control(c):
            out.append(_shown(c))
        else:
            out.append(c)
    return "".join(out)


def from_one_line(text: str) -> str:
    """Inverse of :func:`one_line`."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if c == "\\" and nxt == "\\":
            out.append("\\")
            i += 2
        elif c == "\\" and nxt in _UNESCAPE:
            out.append(_UNESCAPE[nxt])
            i += 2
        elif c == "\\" and nxt == "x" and _hex(text[i + 2 : i + 4], 2):
            out.append(chr(int(text[i + 2 : i + 4], 16)))
            i += 4
        elif c == "\\" and nxt == "u" and _hex(text[i + 2 : i + 6], 4):
            out.append(chr(int(text[i + 2 : i + 6], 16)))
            i += 6
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in "0123456789abcdefABCDEF" for c in s)


def _shown(c: str) -> str:
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def _controls(text: str, keep: str = "") -> str:
    """Control characters (C0 but ``keep``, DEL, C1), line and paragraph separators, noncharacters U+FFFE/U+FFFF
    and lone surrogates shown as escapes: what no text output should carry raw."""
    return "".join(c if c in keep or not _is_control(c) else _shown(c) for c in text)


def xml_text(text: Any, attribute: bool = False) -> str:
    """``text`` for an XML 1.0 element (or, ``attribute``, a double-quoted attribute): well-formed whatever it holds."""
    s = _controls(str(text)).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return s.replace('"', "&quot;") if attribute else s


_MD_ESCAPE = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\r": " ", "\n": " "}
#: the Markdown punctuation escaped inline: emphasis, code, links and table cells (other punctuation only matters at a
#: line's start, where a user value never stands)
_MD_PUNCT = set("\\`*[]|")


def markdown_text(text: Any) -> str:
    """User text as literal Markdown inline text (safe in a table cell): HTML characters become entities, Markdown
    punctuation is backslash-escaped and control characters shown as escapes, so a value such as ``--><script>`` or
    ``*x*`` renders as typed."""
    return "".join(_MD_ESCAPE.get(c) or ("\\" + c if c in _MD_PUNCT else c) for c in _controls(str(text), keep="\r\n"))


def code_span(text: Any) -> str:
    """An inline code span that survives backticks in ``text`` (the fence is longer than any backtick run in it);
    line breaks become spaces and other control characters escapes."""
    s = _controls(str(text).replace("\r", " ").replace("\n", " "))
    longest = 0
    run = 0
    for c in s:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    fence = "`" * (longest + 1)
    pad = " " if longest or s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def html_comment(text: Any) -> str:
    """Text already on one line (:func:`one_line`) inside an HTML comment: ``&``, ``<`` and ``>`` as entities (so
    ``-->`` cannot end it)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
