"""Read a launch script without running it: the launcher calls a bash script makes, found from its text alone.

For a script the planner did not render (its bytes differ from the hash the plan directory's manifest records),
``validate`` runs nothing: this reader takes the script's simple statements in order and expands them as bash would,
for the subset launch scripts are written in:

* ``NAME=value``, ``export NAME=value``, ``readonly``/``declare``/``local`` of the same, and arrays ``NAME=( ... )``
  over several lines; ``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``${NAME:=default}``,
  ``"${ARR[@]}"`` and ``${ARR[*]}`` expansions; single quotes, double quotes, backslashes, line continuations,
  comments; ``$0`` and ``$(dirname "$0")`` as the script's own path and directory;
* a launcher call (:data:`planner.launch_capture.STUBS`: torchrun, srun, deepspeed, python, python3, mpirun),
  possibly after ``exec``, ``env VAR=... `` or leading ``VAR=value`` words, is one :class:`Call`.

What it cannot know it does not guess: a command substitution ``$(...)`` or backquotes (other than the dirname of
``$0``), arithmetic ``$((...))``, or a variable set by a command is left as it is written and named in
:attr:`Capture.stderr_tail`; control flow (``if``, ``for``, functions) is not followed: every statement is read once,
in order, whichever branch it is in. The capture says it was read statically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from planner.launch_capture import STUBS, Call, Capture

#: words that start a statement the reader skips whole (its arguments are not launches)
_SKIP = {
    "if",
    "then",
    "else",
    "elif",
    "fi",
    "for",
    "while",
    "until",
    "do",
    "done",
    "case",
    "esac",
    "function",
    "echo",
    "printf",
    "set",
    "shift",
    "return",
    "exit",
    "cd",
    "source",
    ".",
    "trap",
    "wait",
    "unset",
    "test",
    "[",
    "[[",
}
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)$", re.S)
_VAR = re.compile(r"\$(?:\{(#?)([A-Za-z_][A-Za-z0-9_]*|[0-9@*#?])(\[[@*0-9]+\])?(?:(:?[-=+?])((?:[^{}]|\{[^{}]*\})*))?\}|([A-Za-z_][A-Za-z0-9_]*|[0-9@*#?$]))")


@dataclass
class _State:
    script: str
    scalars: dict[str, str] = field(default_factory=dict)
    arrays: dict[str, list[str]] = field(default_factory=dict)
    exported: set[str] = field(default_factory=set)
    unknown: list[str] = field(default_factory=list)


def _statements(text: str) -> list[tuple[int, str]]:
    """(last line, text) of each logical statement: continuations joined, comments dropped, ``;`` and newlines split
    outside quotes, an array assignment's parentheses kept together."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    quote: str | None = None
    depth = 0
    line = 1
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if quote == "'":
            buf.append(c)
            if c == "'":
                quote = None
        elif c == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                line += 1
                i += 2
                continue
            buf.append(text[i : i + 2])
            i += 2
            continue
        elif quote == '"':
            buf.append(c)
            if c == '"':
                quote = None
            elif c == "\n":
                line += 1
        elif c in "'\"":
            quote = c
            buf.append(c)
        elif c == "#" and (not buf or buf[-1][-1:] in (" ", "\t", "\n", ";", "(")):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif c == "(":
            depth += 1
            buf.append(c)
        elif c == ")":
            depth = max(0, depth - 1)
            buf.append(c)
        elif c in "\n;" or (c == "&" and text[i : i + 2] == "&&") or (c == "|" and text[i : i + 2] == "||"):
            if c == "\n":
                line += 1
            if depth and c == "\n":
                buf.append(" ")
            else:
                statement = "".join(buf).strip()
                if statement:
                    out.append((line - (1 if c == "\n" else 0), statement))
                buf = []
                if c in "&|":
                    i += 2
                    continue
        else:
            buf.append(c)
        i += 1
    statement = "".join(buf).strip()
    if statement:
        out.append((line, statement))
    return out


def _expand(st: _State, s: str, quoted: bool) -> list[str] | str:
    """``s`` with its variables expanded; a whole ``${ARR[@]}`` word gives the array's elements (a list)."""
    if re.fullmatch(r"\$(@|\{@\})", s):
        return []  # the script's own arguments: validate runs it with none
    whole = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\[[@*]\]\}", s)
    if whole and whole.group(1) in st.arrays:
        return list(st.arrays[whole.group(1)])

    def one(m: re.Match[str]) -> str:
        length, name, index, op, default = m.group(1), m.group(2) or m.group(6), m.group(3), m.group(4), m.group(5)
        if name == "0":
            return st.script
        if name in st.arrays:
            values = st.arrays[name]
            if index in ("[@]", "[*]"):
                joined = " ".join(values)
            else:
                k = int(index[1:-1]) if index else 0
                joined = values[k] if k < len(values) else ""
            return str(len(values)) if length else joined
        value: str | None = st.scalars.get(name)
        if length:
            return str(len(value or ""))
        if op in (":-", ":=") and not value or op in ("-", "=") and value is None:
            value = str(_expand(st, default or "", True))
            if op.endswith("="):
                st.scalars[name] = value
        if value is None:
            if name not in st.unknown and not name.isdigit() and name not in "@*#?$":
                st.unknown.append(name)
            return ""
        return value

    return _VAR.sub(one, s)


def _words(st: _State, statement: str) -> list[str]:
    """The words of one statement after quote removal and expansion (unquoted expansions split on blanks)."""
    words: list[str] = []
    cur: list[str] = []
    has = False
    i, n = 0, len(statement)
    while i < n:
        c = statement[i]
        if c in " \t\n":
            if has:
                words.append("".join(cur))
            cur, has = [], False
            i += 1
            continue
        has = True
        if c == "'":
            j = statement.find("'", i + 1)
            j = n if j < 0 else j
            cur.append(statement[i + 1 : j])
            i = j + 1
        elif c == '"':
            j, buf = i + 1, []
            while j < n and statement[j] != '"':
                if statement[j] == "\\" and j + 1 < n and statement[j + 1] in '"\\$`':
                    buf.append(statement[j + 1])
                    j += 2
                    continue
                buf.append(statement[j])
                j += 1
            inner = "".join(buf)
            value = _expand(st, _dirname_of_self(st, inner), True)
            if isinstance(value, list):
                if cur:
                    words.append("".join(cur))
                words.extend(value[:-1])
                cur = [value[-1]] if value else []
                has = bool(value) or bool(cur)
            else:
                cur.append(value)
            i = j + 1
        elif c == "\\" and i + 1 < n:
            cur.append(statement[i + 1])
            i += 2
        else:
            j = i
            while j < n and statement[j] not in " \t\n'\"\\":
                j += 1
            value = _expand(st, _dirname_of_self(st, statement[i:j]), False)
            if isinstance(value, list):
                words.extend(["".join(cur) + value[0], *value[1:]] if value else [])
                cur, has = [], False
            else:
                parts = value.split()
                if not parts:
                    pass
                elif len(parts) == 1:
                    cur.append(parts[0])
                else:
                    words.append("".join(cur) + parts[0])
                    words.extend(parts[1:-1])
                    cur = [parts[-1]]
            i = j
    if has:
        words.append("".join(cur))
    return words


def _dirname_of_self(st: _State, s: str) -> str:
    """``$(dirname "$0")`` and ``$(cd "$(dirname "$0")" && pwd)`` as the script's directory; other command
    substitutions are named as unknown and left as written."""
    s = re.sub(r"\$\((?:cd\s+)?\"?\$\(dirname\s+\"?\$\{?0\}?\"?\)\"?(?:\s*&&\s*pwd)?\)", str(Path(st.script).parent), s)
    s = re.sub(r"\$\(dirname\s+\"?\$\{?(?:0|BASH_SOURCE(?:\[0\])?)\}?\"?\)", str(Path(st.script).parent), s)
    if "$(" in s or "`" in s:
        where = s[s.find("$(") if "$(" in s else s.find("`") :][:60]
        if where not in st.unknown:
            st.unknown.append(where)
    return s


def read_script(path: Path | None = None, text: str | None = None) -> Capture:
    """The launcher calls of the script at ``path`` (or ``text``), read without running it (module docstring)."""
    script = str(path.resolve()) if path is not None else "script.sh"
    if text is None:
        assert path is not None
        text = path.read_text(encoding="utf-8", errors="replace")
    st = _State(script)
    calls: list[Call] = []
    trace: list[tuple[str, int, str]] = []
    for line, statement in _statements(text):
        head = statement.split(None, 1)[0] if statement.split() else ""
        m = _ASSIGN.match(statement)
        decl = head in ("export", "readonly", "declare", "local", "typeset")
        if decl:
            rest = statement.split(None, 1)[1] if len(statement.split(None, 1)) > 1 else ""
            for word in rest.split():
                if word.startswith("-"):
                    continue
                name = word.split("=", 1)[0]
                if head == "export":
                    st.exported.add(name)
            m = _ASSIGN.match(re.sub(r"^(?:-\w+\s+)*", "", rest.strip()))
        if m:
            name, append, value = m.group(1), m.group(2), m.group(3).strip()
            if value.startswith("(") and value.endswith(")"):
                items = _words(st, value[1:-1])
                st.arrays[name] = (st.arrays.get(name, []) if append else []) + items
                st.scalars.pop(name, None)
            else:
                words = _words(st, value) if value else [""]
                st.scalars[name] = (st.scalars.get(name, "") if append else "") + " ".join(words)
                st.arrays.pop(name, None)
            trace.append((script, line, statement))
            continue
        if decl or head in _SKIP or head.endswith("()"):
            continue
        words = _words(st, statement)
        env: dict[str, str] = {k: st.scalars[k] for k in sorted(st.exported) if k in st.scalars}
        while words and (words[0] in ("exec", "env", "command", "nohup", "time") or _ASSIGN.match(words[0])):
            assign = _ASSIGN.match(words[0])
            if assign:
                env[assign.group(1)] = assign.group(3)
            words = words[1:]
        if words and Path(words[0]).name in STUBS:
            trace.append((script, line, " ".join(words)))
            calls.append(Call((Path(words[0]).name, *words[1:]), env))
    unknown = ""
    if st.unknown:
        unknown = "read without running it: not known statically: " + ", ".join(st.unknown[:5]) + (", ..." if len(st.unknown) > 5 else "")
    return Capture(tuple(calls), 0, False, unknown, None, tuple(trace), 0.0, "read")
