"""Megatron-LM's command-line rules as pure functions: parse a launch script's flags and check them.

The one place that encodes what Megatron-LM core_v0.16.1 accepts for
``pretrain_gpt.py``: ``planner plan --engine megatron`` renders with it and
``planner validate`` checks committed scripts with it. Torch-free.

* :func:`parse_megatron_args` reads the flags passed to ``pretrain_gpt.py`` from a
  bash launch script (line continuations, quotes, comments, ``VAR=value``,
  ``${VAR:-default}``, ``$((arithmetic))``, bash arrays expanded where
  ``"${ARR[@]}"`` is used) or from an args file, keeping each flag's line.
  Control flow is not evaluated: every assignment applies in file order.
* :func:`check_megatron_args` applies Megatron's rules (``validate_args`` in
  megatron/training/arguments.py, ``TransformerConfig.__post_init__``, the
  microbatch calculator and the interleaved schedule of megatron-core) and
  returns :class:`Finding` records with stable rule ids (:data:`RULES`).
* :func:`layout_string` / :func:`parse_layout` write and read
  ``--pipeline-model-parallel-layout``; :func:`split_flags` chooses how a
  planned per-stage layer split is expressed (even, uneven first/last, layout);
  :func:`stage_layers` computes the split Megatron builds from a set of flags.

Sources: /work/shared/reference/engines.md and Megatron-LM at tag core_v0.16.1
(validate_args, core_transformer_config_from_args), megatron-core 0.16.1
(transformer_config.py, transformer_block.get_num_layers_to_build,
pipeline_parallel_layer_layout.py, num_microbatches_calculator.py,
pipeline_parallel/schedules.py). In core_v0.16.1 point-to-point overlap in the
interleaved schedule is on by default (``--no-overlap-p2p-communication`` turns
it off); there is no ``--overlap-p2p-communication`` flag.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Literal, Sequence

from planner.errors import close_matches

MEGATRON_VERSION = "core_v0.16.1"

#: flags pretrain_gpt.py cannot run without (num-layers, hidden-size, heads and max positions are asserted by
#: validate_args; the sequence length and batch sizes define the run)
REQUIRED_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--max-position-embeddings",
    "--micro-batch-size",
    "--global-batch-size",
)

#: rule id -> (severity, one-line title)
RULES: dict[str, tuple[str, str]] = {
    "MEG001": ("error", "a required flag is missing"),
    "MEG002": ("error", "world size not divisible by tp x pp x cp"),
    "MEG003": ("error", "even layer split: layers not divisible over the pipeline (and virtual) stages"),
    "MEG004": ("error", "uneven first/last pipeline stage arithmetic"),
    "MEG005": ("error", "uneven first/last stage flags combined with --account-for-*-in-pipeline-split"),
    "MEG006": ("error", "--pipeline-model-parallel-layout is malformed"),
    "MEG007": ("error", "--pipeline-model-parallel-layout layer counts do not match the model"),
    "MEG008": ("error", "--pipeline-model-parallel-layout: E must appear once, first in the first stage"),
    "MEG009": ("error", "--pipeline-model-parallel-layout: L must appear once, last in the last stage"),
    "MEG010": ("error", "--pipeline-model-parallel-layout: stage count not a multiple of pp"),
    "MEG011": ("error", "--pipeline-model-parallel-layout combined with other split or virtual-stage flags"),
    "MEG012": ("error", "conflicting virtual pipeline flags"),
    "MEG013": ("error", "attention heads not divisible by tp"),
    "MEG014": ("error", "query groups incompatible with tp or heads"),
    "MEG015": ("error", "global batch not divisible by micro batch x dp"),
    "MEG016": ("error", "interleaved schedule: micro-batch count does not fit the pipeline"),
    "MEG017": ("error", "interleaved schedule: pipeline too shallow"),
    "MEG018": ("warning", "--sequence-parallel with tp = 1 is silently dropped"),
    "MEG019": ("error", "--overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce"),
    "MEG020": ("error", "activation recomputation flags do not combine"),
    "MEG021": ("error", "sequence length not a multiple of 2 x cp"),
    "MEG022": ("error", "CUDA_DEVICE_MAX_CONNECTIONS=1 not exported with tp > 1 or cp > 1"),
    "MEG023": ("error", "hidden size not divisible by attention heads"),
    "MEG024": ("error", "max position embeddings shorter than the sequence"),
    "MEG025": ("error", "--fp16 and --bf16 together"),
    "MEG026": ("warning", "--num-query-groups without --group-query-attention is ignored"),
    "MEG027": ("error", "a flag's value is missing or has the wrong type"),
    "MEG028": ("error", "not a Megatron-LM flag, or a stray word"),
    "MEG029": ("warning", "a flag is given twice with different values (the last wins)"),
    "MEG030": ("error", "FFN hidden size not divisible by tp"),
}


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Flag:
    """One flag as pretrain_gpt.py receives it: ``--name`` and its values (none for a switch), with its source line."""

    name: str
    values: tuple[str, ...]
    line: int
    resolved: bool = True  # False when a value came from $(...), $1 or a variable the script never sets
    inline: bool = False  # written as --name=value

    @property
    def value(self) -> str | None:
        return self.values[0] if self.values else None


@dataclass(frozen=True)
class EnvVar:
    """An environment variable the script exports (``export NAME=value`` or ``NAME=value torchrun ...``)."""

    name: str
    value: str | None  # None when not resolvable statically
    line: int


@dataclass(frozen=True)
class MegatronArgs:
    """The flags passed to the training script, the exported environment, and the launcher's world size."""

    kind: str
    flags: tuple[Flag, ...]
    env: tuple[EnvVar, ...] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    launch_line: int | None = None
    script: str | None = None  # the training script as the launch line names it
    notes: tuple[str, ...] = ()
    positionals: tuple[Flag, ...] = ()  # words that are neither a flag nor a flag's value (argparse refuses them)
    words: tuple[str, ...] = ()  # every argument after the script, as expanded (unresolved parts left as written)

    @property
    def world_size(self) -> int | None:
        """nnodes x nproc_per_node when the torchrun line states them (torchrun's default is 1 for an omitted one)."""
        if self.nproc_per_node is None and self.nnodes is None:
            return None
        return (self.nproc_per_node or 1) * (self.nnodes or 1)

    def get(self, name: str) -> Flag | None:
        """The flag as argparse sees it: the last occurrence wins."""
        found = None
        for f in self.flags:
            if f.name == name:
                found = f
        return found

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    def value(self, name: str) -> str | None:
        f = self.get(name)
        return f.value if f else None

    def int(self, name: str, default: int | None = None) -> int | None:
        """The flag's integer value; ``default`` when absent; None when present but not an integer."""
        f = self.get(name)
        if f is None:
            return default
        return _as_int(f.value)

    def line(self, name: str) -> int | None:
        f = self.get(name)
        return f.line if f else None

    def env_value(self, name: str) -> str | None:
        found = None
        for e in self.env:
            if e.name == name:
                found = e.value
        return found

    def argv(self) -> list[str]:
        """The flags as an argv list, as written (``--name=value`` kept); stray positional words left out."""
        out: list[str] = []
        for f in self.flags:
            if f.inline:
                out.append(f"{f.name}={f.value}")
            else:
                out.append(f.name)
                out.extend(f.values)
        return out


@dataclass(frozen=True)
class Finding:
    """One rule violation: which rule, how bad, where, what, and how to fix it."""

    rule: str
    severity: Literal["error", "warning"]
    line: int | None
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{self.rule} {self.severity}: {where}{self.message} Fix: {self.fix}"


# --------------------------------------------------------------------------- Megatron's flag table


@dataclass(frozen=True)
class FlagSpec:
    name: str
    nargs: str  # "0" (switch), "1", "3", "+" or "*"
    type: str  # "int", "float", "str" or "-"


@lru_cache(maxsize=1)
def flag_table() -> dict[str, FlagSpec]:
    """Every long option of Megatron-LM core_v0.16.1's argument parser (templates/megatron/flags_core_v0.16.1.tsv)."""
    from planner.resources import templates_dir

    path = Path(templates_dir()) / "megatron" / f"flags_{MEGATRON_VERSION}.tsv"
    table: dict[str, FlagSpec] = {}
    if not path.is_file():  # an install without the table: unknown-flag and value-type checks are skipped
        return table
    for raw in path.read_text().splitlines():
        if not raw or raw.startswith("#"):
            continue
        name, nargs, typ = raw.split("\t")
        table[name] = FlagSpec(name, nargs, typ)
    return table


# --------------------------------------------------------------------------- bash lexer


@dataclass(frozen=True)
class _Part:
    kind: str  # lit | var | arr | cmd | arith | pos
    text: str
    quoted: bool
    op: str = ""  # ${X<op>arg}: ":-", "-", ":=", "=", ":+", "+", ":?", "?"
    arg: tuple["_Part", ...] = ()


@dataclass(frozen=True)
class _Word:
    parts: tuple[_Part, ...]
    line: int

    def literal(self) -> str | None:
        """The word's text when it is made only of unquoted or quoted literals."""
        if all(p.kind == "lit" for p in self.parts):
            return "".join(p.text for p in self.parts)
        return None


@dataclass(frozen=True)
class _ArrayAssign:
    name: str
    append: bool
    words: tuple[_Word, ...]
    line: int


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
_BRACE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!])(?:\[([^\]]*)\])?(?::?[-=?+].*)?$", re.S)
_WORD_END = set(" \t\r\n;&|<>()")


class _Lexer:
    """Just enough of POSIX/bash word syntax for launch scripts: words with their quoting and expansions."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.line = 1
        self.heredocs: list[tuple[str, bool]] = []

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def commands(self) -> list[list[_Word | _ArrayAssign]]:
        out: list[list[_Word | _ArrayAssign]] = []
        cur: list[_Word | _ArrayAssign] = []

        def end() -> None:
            nonlocal cur
            if cur:
                out.append(cur)
            cur = []

        while self.i < len(self.s):
            c = self.peek()
            if c == "\\" and self.peek(1) == "\n":
                self.i += 2
                self.line += 1
            elif c in " \t\r":
                self.i += 1
            elif c == "\n":
                end()
                self.i += 1
                self.line += 1
                if self.heredocs:
                    self._skip_heredocs()
            elif c in ";&|":
                end()
                self.i += 1
            elif c == "#":
                self._skip_comment()
            elif c in "<>" or (c.isdigit() and self._redirect_ahead()):
                self._skip_redirect()
            elif c in "()":
                self.i += 1  # subshells and function definitions: the parentheses carry no flags
            else:
                word = self._word()
                m = _ASSIGN.match(word.literal() or "") if word.parts and word.parts[0].kind == "lit" and not word.parts[0].quoted else None
                if m and (word.literal() or "") == m.group(0) and self.peek() == "(":
                    self.i += 1
                    cur.append(_ArrayAssign(m.group(1), bool(m.group(2)), tuple(self._array_words()), word.line))
                else:
                    cur.append(word)
        end()
        return out

    def _redirect_ahead(self) -> bool:
        j = self.i
        while j < len(self.s) and self.s[j].isdigit():
            j += 1
        return j < len(self.s) and self.s[j] in "<>"

    def _skip_comment(self) -> None:
        while self.i < len(self.s) and self.s[self.i] != "\n":
            self.i += 1

    def _skip_redirect(self) -> None:
        """Drop a redirection: ``2>&1`` (no target), ``> file``, ``>> file``, ``<<EOF`` (and its here-document)."""
        while self.peek().isdigit():
            self.i += 1
        start = self.i
        while self.peek() in ("<", ">", "&", "|") and self.peek():
            self.i += 1
        op = self.s[start : self.i]
        if op == "<<" and self.peek() == "-":
            op, self.i = "<<-", self.i + 1
        if op.endswith("&") and (self.peek().isdigit() or self.peek() == "-"):
            while self.peek().isdigit() or self.peek() == "-":
                self.i += 1
            return  # fd duplication: no target word
        while self.peek() in (" ", "\t"):
            self.i += 1
        if not self.peek() or self.peek() in _WORD_END:
            return
        target = self._word()
        if op in ("<<", "<<-"):
            self.heredocs.append(("".join(p.text for p in target.parts), op == "<<-"))

    def _skip_heredocs(self) -> None:
        """After the newline that ends a command: skip the bodies of its here-documents."""
        for delim, strip_tabs in self.heredocs:
            while self.i < len(self.s):
                end = self.s.find("\n", self.i)
                end = len(self.s) if end < 0 else end
                line = self.s[self.i : end]
                self.i = min(end + 1, len(self.s))
                self.line += 1
                if (line.lstrip("\t") if strip_tabs else line) == delim:
                    break
        self.heredocs = []

    def _array_words(self) -> list[_Word]:
        words: list[_Word] = []
        while self.i < len(self.s):
            c = self.peek()
            if c == "\\" and self.peek(1) == "\n":
                self.i += 2
                self.line += 1
            elif c in " \t\r":
                self.i += 1
            elif c == "\n":
                self.i += 1
                self.line += 1
            elif c == "#":
                self._skip_comment()
            elif c == ")":
                self.i += 1
                return words
            elif c in ";&|<>(":
                self.i += 1
            else:
                words.append(self._word())
        return words

    def _word(self) -> _Word:
        line = self.line
        parts: list[_Part] = []
        buf: list[str] = []

        def flush(quoted: bool = False) -> None:
            if buf:
                parts.append(_Part("lit", "".join(buf), quoted))
                buf.clear()

        while self.i < len(self.s):
            c = self.peek()
            if c in _WORD_END:
                break
            if c == "\\":
                nxt = self.peek(1)
                self.i += 2
                if nxt == "\n":
                    self.line += 1
                elif nxt:
                    flush()
                    parts.append(_Part("lit", nxt, True))
            elif c == "'":
                flush()
                j = self.s.find("'", self.i + 1)
                j = len(self.s) if j < 0 else j
                text = self.s[self.i + 1 : j]
                self.line += text.count("\n")
                parts.append(_Part("lit", text, True))
                self.i = j + 1
            elif c == "$" and self.peek(1) == "'":
                flush()
                parts.append(_Part("lit", self._ansi_c(), True))
            elif c == '"':
                flush()
                self.i += 1
                parts.extend(self._double_quoted())
            elif c == "$":
                flush()
                parts.append(self._dollar(quoted=False))
            elif c == "`":
                flush()
                parts.append(_Part("cmd", self._backtick(), False))
            else:
                buf.append(c)
                self.i += 1
        flush()
        return _Word(tuple(parts), line)

    def _ansi_c(self) -> str:
        self.i += 2
        out: list[str] = []
        esc = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "r": "\r", "a": "\a", "0": "\0"}
        while self.i < len(self.s) and self.peek() != "'":
            c = self.peek()
            if c == "\\" and self.peek(1):
                out.append(esc.get(self.peek(1), "\\" + self.peek(1)))
                self.i += 2
                continue
            if c == "\n":
                self.line += 1
            out.append(c)
            self.i += 1
        self.i += 1
        return "".join(out)

    def _double_quoted(self) -> list[_Part]:
        parts: list[_Part] = []
        buf: list[str] = []
        while self.i < len(self.s):
            c = self.peek()
            if c == '"':
                self.i += 1
                break
            if c == "\\" and self.peek(1) in ('"', "\\", "$", "`", "\n"):
                if self.peek(1) == "\n":
                    self.line += 1
                else:
                    buf.append(self.peek(1))
                self.i += 2
            elif c == "$":
                if buf:
                    parts.append(_Part("lit", "".join(buf), True))
                    buf = []
                parts.append(self._dollar(quoted=True))
            elif c == "`":
                if buf:
                    parts.append(_Part("lit", "".join(buf), True))
                    buf = []
                parts.append(_Part("cmd", self._backtick(), True))
            else:
                if c == "\n":
                    self.line += 1
                buf.append(c)
                self.i += 1
        if buf or not parts:
            parts.append(_Part("lit", "".join(buf), True))  # "" stays a (quoted, empty) word; "$@" may vanish
        return parts

    def _balanced(self, open_: str, close: str) -> str:
        """Text up to the matching ``close`` (self.i just past the opening one); quotes respected."""
        depth, start = 1, self.i
        while self.i < len(self.s):
            c = self.peek()
            if c == "\\":
                self.i += 2
                continue
            if c in "'\"":
                j = self.s.find(c, self.i + 1)
                self.i = len(self.s) if j < 0 else j + 1
                continue
            if c == "\n":
                self.line += 1
            if c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    text = self.s[start : self.i]
                    self.i += 1
                    return text
            self.i += 1
        return self.s[start:]

    def _backtick(self) -> str:
        j = self.s.find("`", self.i + 1)
        j = len(self.s) if j < 0 else j
        text = self.s[self.i + 1 : j]
        self.line += text.count("\n")
        self.i = j + 1
        return text

    def _dollar(self, quoted: bool) -> _Part:
        nxt = self.peek(1)
        if nxt == "(" and self.peek(2) == "(":
            self.i += 3
            text = self._balanced("(", ")")
            if self.peek() == ")":
                self.i += 1
            return _Part("arith", text[:-1] if text.endswith(")") else text, quoted)
        if nxt == "(":
            self.i += 2
            return _Part("cmd", self._balanced("(", ")"), quoted)
        if nxt == "{":
            self.i += 2
            return self._brace(self._balanced("{", "}"), quoted)
        m = _NAME.match(self.s, self.i + 1)
        if m:
            self.i = m.end()
            return _Part("var", m.group(0), quoted)
        if nxt and (nxt.isdigit() or nxt in "@*#?$!-"):
            self.i += 2
            return _Part("pos", nxt, quoted)
        self.i += 1
        return _Part("lit", "$", quoted)

    def _brace(self, body: str, quoted: bool) -> _Part:
        m = _BRACE.match(body)
        if not m or body.startswith("#") and len(body) > 1 or body.startswith("!"):
            return _Part("cmd", "${" + body + "}", quoted)  # ${#X}, ${!X}, ${X/a/b}, ...: not evaluated
        name, index = m.group(1), m.group(2)
        rest = body[len(name) + (len(index) + 2 if index is not None else 0) :]
        if not name[0].isalpha() and name[0] != "_":
            return _Part("pos", name, quoted)
        if index in ("@", "*"):
            return _Part("arr", name, quoted)
        if index is not None:
            return _Part("cmd", "${" + body + "}", quoted) if index != "0" else self._with_op(_Part("var", name, quoted), rest, quoted)
        return self._with_op(_Part("var", name, quoted), rest, quoted)

    def _with_op(self, part: _Part, rest: str, quoted: bool) -> _Part:
        if not rest:
            return part
        op = rest[:2] if rest[:1] == ":" else rest[:1]
        arg_text = rest[len(op) :]
        sub = _Lexer(arg_text)
        sub.line = self.line
        return _Part("var", part.text, quoted, op, sub._word_all())

    def _word_all(self) -> tuple[_Part, ...]:
        parts: list[_Part] = []
        while self.i < len(self.s):
            if self.peek() in _WORD_END:
                parts.append(_Part("lit", self.peek(), False))
                self.i += 1
                continue
            parts.extend(self._word().parts)
        return tuple(parts)


# --------------------------------------------------------------------------- bash interpreter


@dataclass(frozen=True)
class _Item:
    """One field after expansion: its text, the line it was written on, and whether it is known statically."""

    text: str
    line: int
    resolved: bool = True


@dataclass
class _Value:
    scalar: _Item | None = None
    array: list[_Item] | None = None

    def items(self) -> list[_Item]:
        if self.array is not None:
            return list(self.array)
        return [self.scalar] if self.scalar is not None else []

    def first(self) -> _Item | None:
        if self.array is not None:
            return self.array[0] if self.array else None
        return self.scalar


_ARITH_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.floordiv,
    ast.Mod: operator.mod,
}


def _arith(expr: str) -> int | None:
    """Integer arithmetic as bash's $((...)) for + - * / % and parentheses; None for anything else."""
    try:
        tree = ast.parse(expr.strip() or "0", mode="eval")
    except SyntaxError:
        return None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH_OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
                raise ZeroDivisionError
            if isinstance(node.op, (ast.Div, ast.FloorDiv)):
                q = abs(a) // abs(b)
                return q if (a >= 0) == (b >= 0) else -q
            return _ARITH_OPS[type(node.op)](a, b)
        raise ValueError(node)

    try:
        return int(ev(tree))
    except (ValueError, ZeroDivisionError, TypeError):
        return None


_KEYWORDS_SKIP = {"fi", "done", "esac", "}", "{", "then", "do", "else", "elif", "if", "while", "until", "!", "time", "exec", "command", "nohup"}
_DECLARE = {"export", "declare", "typeset", "local", "readonly"}
_LAUNCHERS = ("torchrun",)


class _Interpreter:
    def __init__(self, kind: str):
        self.kind = kind
        self.vars: dict[str, _Value] = {}
        self.env: list[EnvVar] = []
        self.notes: list[str] = []
        self.launch: tuple[list[_Item], _Item, list[_Item]] | None = None  # launcher items, script, args
        self.all_items: list[_Item] = []

    # expansion -----------------------------------------------------------
    def _lookup(self, name: str) -> _Value | None:
        return self.vars.get(name)

    def _expand_parts(self, parts: Sequence[_Part], line: int, split: bool = True) -> list[tuple[list[str], int | None, bool, bool]]:
        """Fields as (text pieces, line of the array element that started it, resolved, had quoted text).

        Unquoted expansions are split on whitespace; ``"${A[@]}"`` gives one field per element;
        a field with no text is dropped unless it had quotes (bash's rules, minus globbing).
        """
        fields: list[list] = []
        cur: list | None = None

        def current() -> list:
            nonlocal cur
            if cur is None:
                cur = [[], None, True, False]
                fields.append(cur)
            return cur

        def put(text: str, quoted: bool, resolved: bool, elem_line: int | None) -> None:
            f = current()
            f[0].append(text)
            f[1] = f[1] if f[1] is not None else elem_line
            f[2] = f[2] and resolved
            f[3] = f[3] or quoted

        def put_split(text: str, resolved: bool, elem_line: int | None) -> None:
            nonlocal cur
            if text[:1].isspace():
                cur = None
            for k, chunk in enumerate(text.split()):
                if k:
                    cur = None
                put(chunk, False, resolved, elem_line)
            if text[-1:].isspace():
                cur = None

        current()
        for p in parts:
            if p.kind == "lit":
                put(p.text, p.quoted, True, None)
            elif p.kind == "var":
                val = self._var_value(p, line)
                if val is None:
                    put("${" + p.text + "}", p.quoted, False, None)
                elif p.quoted or not split:
                    put(val.text, p.quoted, val.resolved, None)
                else:
                    put_split(val.text, val.resolved, None)
            elif p.kind == "arr":
                v = self._lookup(p.text)
                if v is None:
                    self._note(f"array {p.text} is used but never set in the script")
                for k, e in enumerate(v.items() if v is not None else []):
                    if k:
                        cur = None
                    if p.quoted:
                        put(e.text, True, e.resolved, e.line)
                    else:
                        put_split(e.text, e.resolved, e.line)
            elif p.kind == "arith":
                val = self._arith(p.text, line)
                put(str(val) if val is not None else "$((" + p.text + "))", p.quoted, val is not None, None)
            elif p.kind == "pos":
                if p.text in "@*":
                    self._note('extra command-line arguments ("$@") are not known statically')
                    continue
                put("$" + p.text, p.quoted, False, None)
            else:  # cmd
                put("$(" + p.text + ")", p.quoted, False, None)
        return [(f[0], f[1], f[2], f[3]) for f in fields if "".join(f[0]) or f[3]]

    def _var_value(self, p: _Part, line: int) -> _Item | None:
        v = self._lookup(p.text)
        item = v.first() if v is not None else None
        is_set = item is not None
        non_empty = is_set and item.text != ""
        op = p.op
        if not op:
            return item
        use_arg = (op == ":-" and not non_empty) or (op == "-" and not is_set) or (op in (":=", "=") and not (non_empty if op == ":=" else is_set))
        if op in (":+", "+"):
            cond = non_empty if op == ":+" else is_set
            return self._join(p.arg, line) if cond else _Item("", line)
        if op in (":?", "?"):
            return item if (non_empty if op == ":?" else is_set) else None
        if use_arg:
            val = self._join(p.arg, line)
            if op in (":=", "="):
                self.vars[p.text] = _Value(scalar=val)
            return val
        return item

    def _join(self, parts: Sequence[_Part], line: int) -> _Item:
        fields = self._expand_parts(parts, line)
        text = " ".join("".join(f[0]) for f in fields)
        return _Item(text, line, all(f[2] for f in fields))

    def _arith(self, expr: str, line: int) -> int | None:
        unresolved = False

        def sub(m: re.Match) -> str:
            nonlocal unresolved
            name = m.group(1) or m.group(2) or m.group(3)
            v = self._lookup(name)
            item = v.first() if v is not None else None
            if item is None or not item.resolved or _as_int(item.text) is None:
                if item is None:
                    return "0"  # bash: an unset name is 0
                unresolved = True
                return "0"
            return str(_as_int(item.text))

        text = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)|\b([A-Za-z_][A-Za-z0-9_]*)\b", sub, expr)
        if unresolved or "$" in text:
            return None
        return _arith(text)

    def expand(self, word: _Word) -> list[_Item]:
        out = []
        for pieces, fl, res, _ in self._expand_parts(word.parts, word.line):
            out.append(_Item("".join(pieces), fl if fl is not None else word.line, res))
        return out

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    # statements ------------------------------------------------------------
    def assign(self, tok: _Word | _ArrayAssign, export: bool = False) -> None:
        if isinstance(tok, _ArrayAssign):
            items = [it for w in tok.words for it in self.expand(w)]
            old = self.vars.get(tok.name)
            if tok.append and old is not None:
                items = old.items() + items
            self.vars[tok.name] = _Value(array=items)
            if export:
                self.env.append(EnvVar(tok.name, None, tok.line))
            return
        lit0 = tok.parts[0].text
        m = _ASSIGN.match(lit0)
        assert m is not None
        name, append = m.group(1), bool(m.group(2))
        rest = (_Part("lit", lit0[m.end() :], tok.parts[0].quoted),) + tok.parts[1:]
        fields = self._expand_parts(rest, tok.line, split=False)  # no word splitting in an assignment
        text = " ".join("".join(f[0]) for f in fields) if fields else ""
        item = _Item(text, tok.line, all(f[2] for f in fields))
        old = self.vars.get(name)
        if append and old is not None:
            if old.array is not None:
                self.vars[name] = _Value(array=old.array + [item])
            else:
                prev = old.first() or _Item("", tok.line)
                self.vars[name] = _Value(scalar=_Item(prev.text + item.text, tok.line, prev.resolved and item.resolved))
        else:
            self.vars[name] = _Value(scalar=item)
        if export:
            self.env.append(EnvVar(name, item.text if item.resolved else None, tok.line))

    @staticmethod
    def is_assignment(tok: _Word | _ArrayAssign) -> bool:
        if isinstance(tok, _ArrayAssign):
            return True
        return bool(tok.parts) and tok.parts[0].kind == "lit" and not tok.parts[0].quoted and bool(_ASSIGN.match(tok.parts[0].text))

    def run(self, commands: list[list[_Word | _ArrayAssign]]) -> None:
        for cmd in commands:
            self.command(cmd)

    def command(self, cmd: list[_Word | _ArrayAssign]) -> None:
        toks = list(cmd)
        while toks and isinstance(toks[0], _Word) and toks[0].literal() in _KEYWORDS_SKIP:
            toks.pop(0)
        if not toks:
            return
        prefix = []
        while toks and self.is_assignment(toks[0]):
            prefix.append(toks.pop(0))
        if not toks:
            for tok in prefix:
                self.assign(tok)
            return
        head = toks[0].literal() if isinstance(toks[0], _Word) else None
        if head in _DECLARE:
            exported = head == "export"
            for tok in toks[1:]:
                if isinstance(tok, _Word) and (tok.literal() or "").startswith("-"):
                    exported = exported or "x" in (tok.literal() or "")
                    continue
                if self.is_assignment(tok):
                    self.assign(tok, export=exported)
                elif isinstance(tok, _Word) and exported and tok.literal():
                    v = self.vars.get(tok.literal())
                    item = v.first() if v else None
                    self.env.append(EnvVar(tok.literal(), item.text if item and item.resolved else None, tok.line))
            return
        if head == "unset":
            for tok in toks[1:]:
                if isinstance(tok, _Word) and tok.literal():
                    self.vars.pop(tok.literal(), None)
            return
        items = [it for tok in toks if isinstance(tok, _Word) for it in self.expand(tok)]
        self.all_items.extend(items)
        self._maybe_launch(items, prefix)

    def _maybe_launch(self, items: list[_Item], prefix: list) -> None:
        scripts = [k for k, it in enumerate(items) if it.text.endswith(".py") and not it.text.startswith("-") and _runs_script(items[:k])]
        if not scripts:
            return
        preferred = [k for k in scripts if Path(items[k].text).name.startswith("pretrain")]
        k = (preferred or scripts)[0]
        if self.launch is not None:
            old_is_pretrain = Path(self.launch[1].text).name.startswith("pretrain")
            if old_is_pretrain or not preferred:
                return
        self.launch = (items[:k], items[k], items[k + 1 :])
        for tok in prefix:  # NAME=value torchrun ...: in the environment of the launch
            self.assign(tok, export=True)


_INTERPRETER = re.compile(r"^(torchrun|deepspeed|python(\d+(\.\d+)?)?)$")


def _runs_script(before: Sequence[_Item]) -> bool:
    """Whether a word after ``before`` is a script being run: it comes first, or after torchrun/python/deepspeed."""
    return not before or any(_INTERPRETER.match(Path(it.text).name) for it in before)


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    t = text.strip()
    if re.fullmatch(r"[+-]?\d+", t):
        return int(t)
    return None


def _as_float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return None


_NEGATIVE_NUMBER = re.compile(r"^-\d+(\.\d*)?([eE][-+]?\d+)?$|^-\.\d+")


def _is_option(text: str) -> bool:
    return text.startswith("-") and len(text) > 1 and not _NEGATIVE_NUMBER.match(text)


def _flags_from_items(items: Sequence[_Item]) -> tuple[list[Flag], list[_Item]]:
    """Group argv items into flags (argparse's view, using Megatron's table for how many values each takes)."""
    table = flag_table()
    flags: list[Flag] = []
    stray: list[_Item] = []
    i = 0
    while i < len(items):
        it = items[i]
        if not (it.text.startswith("--") and len(it.text) > 2):
            stray.append(it)
            i += 1
            continue
        name, eq, val = it.text.partition("=")
        i += 1
        if eq:
            flags.append(Flag(name, (val,), it.line, it.resolved, inline=True))
            continue
        spec = table.get(name)
        values: list[_Item] = []
        if spec is not None and spec.nargs == "0":
            pass
        elif spec is not None and spec.nargs.isdigit():
            while len(values) < int(spec.nargs) and i < len(items) and not items[i].text.startswith("--"):
                values.append(items[i])
                i += 1
        else:
            while i < len(items) and not _is_option(items[i].text):
                values.append(items[i])
                i += 1
        flags.append(Flag(name, tuple(v.text for v in values), it.line, it.resolved and all(v.resolved for v in values)))
    return flags, stray


def _launcher_world(launcher: Sequence[_Item]) -> tuple[int | None, int | None, bool]:
    """(nproc_per_node, nnodes, is_torchrun) from a ``torchrun ...`` or ``python -m torch.distributed.run ...`` prefix."""
    texts = [it.text for it in launcher]
    is_torchrun = any(Path(t).name in _LAUNCHERS for t in texts) or any(
        t in ("torch.distributed.run", "torch.distributed.launch") and k > 0 and texts[k - 1] == "-m" for k, t in enumerate(texts)
    )
    if not is_torchrun:
        return None, None, False
    found: dict[str, str | None] = {}
    k = 0
    while k < len(launcher):
        t = launcher[k].text
        key, eq, val = t.partition("=")
        norm = key.replace("_", "-")
        if norm in ("--nproc-per-node", "--nnodes"):
            if eq:
                value, ok = val, launcher[k].resolved
            elif k + 1 < len(launcher):
                value, ok = launcher[k + 1].text, launcher[k + 1].resolved
                k += 1
            else:
                value, ok = None, False
            found[norm] = value if ok else None
        k += 1
    nproc = _as_int(found["--nproc-per-node"]) if found.get("--nproc-per-node") is not None else None
    nnodes = _as_int(found["--nnodes"]) if found.get("--nnodes") is not None else None
    if "--nproc-per-node" in found and nproc is None or "--nnodes" in found and nnodes is None:
        return None, None, True  # stated but not a plain number (e.g. $(nvidia-smi ...), "1:4", "gpu")
    if not found:
        return None, None, True
    return nproc if nproc is not None else 1, nnodes if nnodes is not None else 1, True


def parse_megatron_args(text: str, kind: Literal["script", "args"] = "script") -> MegatronArgs:
    """The flags a launch script (``kind="script"``) or an args file (``kind="args"``) passes to pretrain_gpt.py.

    Script: the first command that runs a ``pretrain*.py`` (else any ``*.py``) script is the launch;
    the words after the script are the flags, with bash arrays, variables and ``$((...))`` expanded;
    ``export NAME=value`` lines are recorded, and the torchrun world size when nnodes and
    nproc-per-node are literal (directly or through variables the script sets). When no launch
    line is found, the flags are collected from every command and array in file order.
    Args file: every word of the file, one flag per line or space separated; ``#`` comments.
    Each flag keeps the line (1-based) it is written on.
    """
    if kind not in ("script", "args"):
        raise ValueError(f"kind must be 'script' or 'args', not {kind!r}")
    commands = _Lexer(text).commands()
    interp = _Interpreter(kind)
    if kind == "args":
        items = []
        for cmd in commands:
            for tok in cmd:
                if isinstance(tok, _Word):
                    items.extend(interp.expand(tok))
        flags, stray = _flags_from_items(items)
        return MegatronArgs(kind, tuple(flags), notes=tuple(interp.notes), positionals=_positionals(stray), words=tuple(it.text for it in items))
    interp.run(commands)
    nproc = nnodes = None
    launch_line = script = None
    words: list[_Item] = []
    if interp.launch is not None:
        launcher, script_item, arg_items = interp.launch
        nproc, nnodes, _ = _launcher_world(launcher)
        launch_line, script = script_item.line, script_item.text
        flags, stray = _flags_from_items(arg_items)
        words = list(arg_items)
    else:
        interp._note("no command running a *.py training script was found; flags were collected from every command and array")
        items = list(interp.all_items)
        for name, v in interp.vars.items():
            if v.array is not None:
                items.extend(v.array)
        items.sort(key=lambda it: it.line)
        flags, stray = _flags_from_items(items)
        words = items
    return MegatronArgs(
        kind,
        tuple(flags),
        env=tuple(interp.env),
        nproc_per_node=nproc,
        nnodes=nnodes,
        launch_line=launch_line,
        script=script,
        notes=tuple(interp.notes),
        positionals=_positionals(stray),
        words=tuple(it.text for it in words),
    )


def _positionals(items: Sequence[_Item]) -> tuple[Flag, ...]:
    return tuple(Flag(it.text, (), it.line, it.resolved) for it in items)


# --------------------------------------------------------------------------- pipeline layout


class LayoutError(ValueError):
    """A --pipeline-model-parallel-layout string that Megatron cannot parse."""


_LAYOUT_CHARS = {"E", "t", "m", "L"}


def parse_layout(s: str) -> list[list[str]]:
    """Stages of a ``--pipeline-model-parallel-layout`` string, each a list of ``E``/``t``/``m``/``L``.

    Same expansion as megatron-core's ``PipelineParallelLayerLayout.parse_str_to_list``:
    commas removed, ``(...)*n`` then ``x*n`` unrolled, stages split on ``|``. Raises
    :class:`LayoutError` for anything Megatron would reject while parsing.
    """
    text = s.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages: list[list[str]] = []
    for stage in text.split("|"):
        bad = sorted({c for c in stage if c not in _LAYOUT_CHARS})
        if bad:
            raise LayoutError(
                f"layout {s!r} has {', '.join(repr(c) for c in bad)} after expansion; "
                "only E (embedding), t (decoder layer), m (MTP layer), L (loss), | (stage separator), "
                "x*n and (...)*n (repetition, no nesting) and commas are understood"
            )
        stages.append(list(stage))
    return stages


def _stage_text(k: int, embedding: bool, loss: bool) -> str:
    body = "t" * k if k <= 3 else f"t*{k}"
    return ("E" if embedding else "") + body + ("L" if loss else "")


def layout_string(stage_layers: Sequence[int], pp: int, has_embedding_first: bool = True, loss_last: bool = True) -> str:
    """The ``--pipeline-model-parallel-layout`` for ``stage_layers`` decoder layers per stage.

    Stages are in Megatron's order (stage i on pipeline rank i % pp, virtual chunk i // pp);
    ``E`` opens the first stage, ``L`` closes the last; runs of equal stages are written as
    ``(t*k|)*n``. Example: ``[1, 2, 2, 2, 2, 2, 2, 1]`` with pp=4 gives ``"Et|(tt|)*6,tL"``.
    """
    counts = [int(k) for k in stage_layers]
    if pp < 1 or not counts or len(counts) % pp:
        raise ValueError(f"{len(counts)} stages do not divide over pp = {pp}")
    if any(k < 0 for k in counts):
        raise ValueError(f"negative layer count in {counts}")
    n = len(counts)
    texts = [_stage_text(k, has_embedding_first and j == 0, loss_last and j == n - 1) for j, k in enumerate(counts)]
    groups: list[tuple[str, int]] = []
    for t in texts:
        if groups and groups[-1][0] == t:
            groups[-1] = (t, groups[-1][1] + 1)
        else:
            groups.append((t, 1))
    out: list[str] = []
    for g, (t, reps) in enumerate(groups):
        last_group = g == len(groups) - 1
        if last_group:
            if reps == 1:
                out.append(t)
            elif reps == 2:
                out.append(f"{t}|{t}")
            else:
                out.append(f"({t}|)*{reps - 1},{t}")
        elif reps == 1:
            out.append(f"{t}|")
        elif t and reps >= 2:
            out.append(f"({t}|)*{reps}")
        else:  # empty stages: "||"
            out.append("|" * reps)
    text = ",".join(out).replace("|,", "|")
    return text


def stage_layers(args: MegatronArgs) -> list[int] | None:
    """Decoder layers Megatron builds on each stage (stage i on rank i % pp, chunk i // pp) for these flags.

    Mirrors megatron-core's ``get_num_layers_to_build``; None when the flags are inconsistent
    (check_megatron_args says why) or not known.
    """
    L = args.int("--num-layers")
    pp = args.int("--pipeline-model-parallel-size", 1)
    if L is None or pp is None or pp < 1:
        return None
    layout = args.value("--pipeline-model-parallel-layout")
    if layout is not None:
        try:
            stages = parse_layout(layout)
        except LayoutError:
            return None
        if len(stages) % pp:
            return None
        return [st.count("t") for st in stages]
    vp = _virtual_size(args, L, pp) or 1
    first = args.int("--decoder-first-pipeline-num-layers")
    last = args.int("--decoder-last-pipeline-num-layers")
    emb = args.has("--account-for-embedding-in-pipeline-split")
    loss = args.has("--account-for-loss-in-pipeline-split")
    per_rank = [0] * pp
    if first is not None or last is not None:
        rest, left = L - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if left < 0 or (left == 0 and rest) or (left and rest % left) or rest < 0:
            return None
        mid = rest // left if left else 0
        per_rank = [mid] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = L + emb + loss
        if total % pp:
            return None
        per_rank = [total // pp] * pp
    if any(r % vp for r in per_rank):
        return None
    out = [per_rank[i % pp] // vp for i in range(pp * vp)]
    if emb:
        out[0] -= 1
    if loss:
        out[-1] -= 1
    if any(k < 0 for k in out):
        return None
    return out


def _virtual_size(args: MegatronArgs, L: int, pp: int) -> int | None:
    """Virtual stages per pipeline rank (None for no interleaving), as validate_args derives it."""
    layout = args.value("--pipeline-model-parallel-layout")
    if layout is not None:
        try:
            n = len(parse_layout(layout))
        except LayoutError:
            return None
        v = n // pp if n % pp == 0 else None
        return v if v and v > 1 else None
    nvs = args.int("--num-virtual-stages-per-pipeline-rank")
    if nvs is not None:
        return nvs if nvs > 1 else None
    nlpvs = args.int("--num-layers-per-virtual-pipeline-stage")
    if nlpvs is not None and nlpvs > 0:
        total = L + args.has("--account-for-embedding-in-pipeline-split") + args.has("--account-for-loss-in-pipeline-split")
        if total % pp or (total // pp) % nlpvs:
            return None
        v = total // pp // nlpvs
        return v if v > 1 else None
    return None


def split_flags(stage_layers_: Sequence[int], pp: int) -> list[tuple[str, str | None]]:
    """The flags that make Megatron build ``stage_layers_`` decoder layers per stage (len = pp x vp).

    Even split: only ``--num-virtual-stages-per-pipeline-rank`` (when vp > 1). Only the first and/or
    last pipeline rank differ (in every virtual chunk alike, as Megatron spreads them):
    ``--decoder-first/last-pipeline-num-layers``. Otherwise ``--pipeline-model-parallel-layout``
    with E in the first stage and L in the last. The result is checked with :func:`stage_layers`.
    """
    counts = [int(k) for k in stage_layers_]
    if pp < 1 or not counts or len(counts) % pp:
        raise ValueError(f"{len(counts)} stages do not divide over pp = {pp}")
    vp = len(counts) // pp
    L = sum(counts)
    base = [("--num-layers", str(L)), ("--pipeline-model-parallel-size", str(pp))]
    vflags = [("--num-virtual-stages-per-pipeline-rank", str(vp))] if vp > 1 else []
    candidates: list[list[tuple[str, str | None]]] = []
    if len(set(counts)) == 1 and counts[0] > 0:
        candidates.append(vflags)
    per_chunk = [counts[c * pp : (c + 1) * pp] for c in range(vp)]
    if pp >= 2 and all(ch == per_chunk[0] for ch in per_chunk) and all(k > 0 for k in counts):
        ch = per_chunk[0]
        if pp == 2 or len(set(ch[1:-1])) == 1:
            mid = ch[1] if pp > 2 else None
            uneven: list[tuple[str, str | None]] = []
            if mid is None or ch[0] != mid:
                uneven.append(("--decoder-first-pipeline-num-layers", str(ch[0] * vp)))
            if mid is not None and ch[-1] != mid:
                uneven.append(("--decoder-last-pipeline-num-layers", str(ch[-1] * vp)))
            candidates.append(vflags + uneven)
    candidates.append([("--pipeline-model-parallel-layout", layout_string(counts, pp))])
    for extra in candidates:
        args = MegatronArgs("args", tuple(Flag(n, (v,) if v is not None else (), 0) for n, v in base + extra))
        if stage_layers(args) == counts:
            return extra
    raise ValueError(f"no Megatron flags express the split {counts} over pp = {pp}")  # pragma: no cover - the layout always does


# --------------------------------------------------------------------------- the model


ACTIVATIONS = ("gelu", "swiglu")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
ARCHITECTURE_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "seq_length",
    "max_position_embeddings",
    "vocab_size",
    "normalization",
    "activation",
    "position_embedding",
)


def architecture_problem(arch: dict | None, model: str = "the model file") -> tuple[str, str] | None:
    """Why a model file's ``architecture()`` dict does not map onto Megatron-LM's GPT model, as (message, hint); None when it does.

    Megatron builds its own model from flags: it needs the shape (ARCHITECTURE_KEYS), a gelu or swiglu
    MLP, LayerNorm or RMSNorm, learned absolute or rotary positions, heads dividing into the query groups.
    The search can call this before planning ``--engine megatron``; the renderer raises it as a UsageError.
    """
    if not arch:
        return (
            f"{model} defines no architecture(): Megatron-LM builds its own GPT model from flags and needs the shape "
            "(layers, hidden size, heads, FFN size, vocabulary, norm, activation, position embedding).",
            "Add architecture(**kwargs) -> dict to the model file (see examples/llama.py), or plan with --engine deepspeed or torch.",
        )
    missing = [k for k in ARCHITECTURE_KEYS if arch.get(k) is None]
    if missing:
        return f"{model}'s architecture() lacks {', '.join(missing)}; Megatron-LM needs them.", "Add the missing keys to architecture()."
    problems = []
    if arch["activation"] not in ACTIVATIONS:
        problems.append(f"activation {arch['activation']!r} (Megatron's GPT model here runs {' or '.join(ACTIVATIONS)})")
    if arch["normalization"] not in NORMALIZATIONS:
        problems.append(f"normalization {arch['normalization']!r} (Megatron runs {' or '.join(NORMALIZATIONS)})")
    if arch["position_embedding"] not in POSITION_EMBEDDINGS:
        problems.append(f"position embedding {arch['position_embedding']!r} (Megatron's GPT model here runs {' or '.join(POSITION_EMBEDDINGS)})")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings", "vocab_size"):
        if not isinstance(arch[key], int) or isinstance(arch[key], bool) or arch[key] < 1:
            problems.append(f"{key} = {arch[key]!r} (a positive integer is needed)")
    heads = arch["num_attention_heads"]
    groups = arch.get("num_query_groups") or heads
    if isinstance(groups, int) and isinstance(heads, int) and groups > 0 and heads % groups:
        problems.append(f"{heads} attention heads in {groups} query groups (the heads must divide into the groups)")
    dropout = arch.get("dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= float(dropout) < 1.0:
        problems.append(f"dropout {dropout!r} (a probability in [0, 1) is needed)")
    if problems:
        return (
            f"{model}'s architecture does not map onto Megatron-LM's GPT model: " + "; ".join(problems) + ".",
            "Plan with --engine deepspeed or torch, which run the model file itself.",
        )
    return None


def tensor_parallel_problems(arch: dict, tp: int) -> list[str]:
    """Why Megatron cannot split this architecture over ``tp`` GPUs (the MEG013, MEG014, MEG030 rules); empty when it can.

    For the search: heads divisible by tp; query groups a multiple or a divisor of tp
    (TransformerConfig); FFN hidden size divisible by tp (the MLP's parallel linear layers).
    """
    out = []
    heads = arch.get("num_attention_heads") or 0
    groups = arch.get("num_query_groups") or heads
    ffn = arch.get("ffn_hidden_size")
    if heads and heads % tp:
        out.append(f"{heads} attention heads are not divisible by tp = {tp}")
    if groups and groups % tp and tp % groups:
        out.append(f"{groups} query groups are neither a multiple nor a divisor of tp = {tp}")
    if ffn and ffn % tp:
        out.append(f"FFN hidden size {ffn} is not divisible by tp = {tp}")
    return out


# --------------------------------------------------------------------------- rules


class _Checker:
    def __init__(self, args: MegatronArgs, world_size: int | None):
        self.a = args
        self.world = world_size if world_size is not None else args.world_size
        self.out: list[Finding] = []

    def add(self, rule: str, line: int | None, message: str, fix: str) -> None:
        self.out.append(Finding(rule, RULES[rule][0], line, message, fix))  # type: ignore[arg-type]

    def line(self, *names: str) -> int | None:
        for n in names:
            ln = self.a.line(n)
            if ln is not None:
                return ln
        return self.a.launch_line

    def run(self) -> list[Finding]:
        a = self.a
        self.flag_syntax()
        for name in REQUIRED_FLAGS:
            if not a.has(name):
                self.add("MEG001", a.launch_line, f"{name} is not given; pretrain_gpt.py needs it.", f"add {name} N to the launch arguments")
        tp = a.int("--tensor-model-parallel-size", 1)
        pp = a.int("--pipeline-model-parallel-size", 1)
        cp = a.int("--context-parallel-size", 1)
        if tp is None or pp is None or cp is None or tp < 1 or pp < 1 or cp < 1:
            return self.finish()  # MEG027 says which
        L = a.int("--num-layers")
        dp = None
        if self.world is not None:
            model = tp * pp * cp
            if self.world % model:
                self.add(
                    "MEG002",
                    self.line("--tensor-model-parallel-size", "--pipeline-model-parallel-size"),
                    f"world size {self.world} is not divisible by tp x pp x cp = {tp} x {pp} x {cp} = {model}.",
                    f"use a world size that is a multiple of {model}, or change the parallel sizes",
                )
            else:
                dp = self.world // model
        if L is not None:
            self.split_rules(L, pp)
        self.attention_rules(tp)
        self.batch_rules(tp, pp, dp, L)
        self.misc_rules(tp, cp)
        return self.finish()

    def finish(self) -> list[Finding]:
        order = {r: k for k, r in enumerate(RULES)}
        return sorted(self.out, key=lambda f: (order[f.rule], f.line or 0, f.message))

    # flag syntax ------------------------------------------------------------
    def flag_syntax(self) -> None:
        table = flag_table()
        for p in self.a.positionals:
            self.add(
                "MEG028",
                p.line,
                f"{p.name!r} is neither a flag nor the value of one (the flag before it takes no more values); pretrain_gpt.py stops with 'unrecognized arguments'.",
                "remove it, or give it the flag it belongs to",
            )
        seen: dict[str, Flag] = {}
        for f in self.a.flags:
            spec = table.get(f.name)
            if spec is None and not table:
                continue
            if spec is None:
                hint = close_matches(f.name.replace("_", "-"), table)
                alt = {"--overlap-p2p-communication": "point-to-point overlap is on by default in core_v0.16.1 (turn it off with --no-overlap-p2p-communication); remove the flag"}
                fix = alt.get(f.name) or (f"did you mean {' or '.join(hint)}?" if hint else "remove it, or check the spelling against Megatron-LM's arguments.py")
                self.add("MEG028", f.line, f"{f.name} is not a flag of Megatron-LM {MEGATRON_VERSION}; pretrain_gpt.py stops with 'unrecognized arguments'.", fix)
                continue
            if f.resolved:
                self._check_values(f, spec)
            prev = seen.get(f.name)
            if prev is not None and prev.values != f.values:
                self.add(
                    "MEG029",
                    f.line,
                    f"{f.name} is given on line {prev.line} ({' '.join(prev.values) or 'switch'}) and again here ({' '.join(f.values) or 'switch'}); argparse keeps the last.",
                    "keep one of them",
                )
            seen[f.name] = f

    def _check_values(self, f: Flag, spec: FlagSpec) -> None:
        n = len(f.values)
        if spec.nargs == "0":
            return  # extra words after a switch are positional arguments; argparse rejects them but they are rare
        want = {"1": (1, 1), "3": (3, 3), "+": (1, None), "*": (0, None)}[spec.nargs]
        if n < want[0] or (want[1] is not None and n > want[1]):
            self.add("MEG027", f.line, f"{f.name} takes {spec.nargs if spec.nargs != '+' else 'one or more'} value(s), got {n}.", f"give {f.name} its value")
            return
        conv = {"int": _as_int, "float": _as_float}.get(spec.type)
        if conv is not None:
            for v in f.values:
                if conv(v) is None:
                    self.add("MEG027", f.line, f"{f.name} expects {'an integer' if spec.type == 'int' else 'a number'}, got {v!r}.", f"give {f.name} a {spec.type} value")

    # layer split --------------------------------------------------------------
    def split_rules(self, L: int, pp: int) -> None:
        a = self.a
        layout = a.value("--pipeline-model-parallel-layout")
        first = a.int("--decoder-first-pipeline-num-layers")
        last = a.int("--decoder-last-pipeline-num-layers")
        uneven = a.has("--decoder-first-pipeline-num-layers") or a.has("--decoder-last-pipeline-num-layers")
        emb = a.has("--account-for-embedding-in-pipeline-split")
        loss = a.has("--account-for-loss-in-pipeline-split")
        nlpvs = a.int("--num-layers-per-virtual-pipeline-stage")
        nvs = a.int("--num-virtual-stages-per-pipeline-rank")
        if a.has("--num-layers-per-virtual-pipeline-stage") and a.has("--num-virtual-stages-per-pipeline-rank"):
            self.add(
                "MEG012",
                self.line("--num-virtual-stages-per-pipeline-rank"),
                "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are both given; validate_args allows at most one.",
                "keep --num-virtual-stages-per-pipeline-rank",
            )
        if layout is not None:
            self.layout_rules(layout, L, pp, uneven, emb, loss)
            return
        if uneven:
            if a.has("--num-layers-per-virtual-pipeline-stage") and not a.has("--num-virtual-stages-per-pipeline-rank"):
                self.add(
                    "MEG012",
                    self.line("--num-layers-per-virtual-pipeline-stage"),
                    "uneven first/last stages with --num-layers-per-virtual-pipeline-stage: validate_args requires --num-virtual-stages-per-pipeline-rank instead.",
                    "replace it with --num-virtual-stages-per-pipeline-rank V",
                )
            if emb or loss:
                self.add(
                    "MEG005",
                    self.line("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
                    "--decoder-first/last-pipeline-num-layers cannot be combined with --account-for-embedding/loss-in-pipeline-split (TransformerConfig raises ValueError).",
                    "drop the account-for flags (the first/last counts already make room), or use an even split",
                )
            self.uneven_rules(L, pp, first, last, nvs)
            return
        total = L + emb + loss
        extra = " (counting the embedding and/or loss as a layer each)" if emb or loss else ""
        if total % pp:
            self.add(
                "MEG003",
                self.line("--num-layers", "--pipeline-model-parallel-size"),
                f"{total} layers{extra} do not divide over pp = {pp} ({total} = {total // pp} x {pp} + {total % pp}).",
                "choose pp dividing the layer count, or give --decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout",
            )
            return
        per_rank = total // pp
        if nlpvs is not None and not a.has("--num-virtual-stages-per-pipeline-rank"):
            if nlpvs < 1 or per_rank % nlpvs:
                self.add(
                    "MEG003",
                    self.line("--num-layers-per-virtual-pipeline-stage"),
                    f"{per_rank} layers per pipeline rank are not divisible by --num-layers-per-virtual-pipeline-stage {nlpvs}.",
                    "pick a value dividing the layers per rank",
                )
        elif nvs is not None and nvs > 1 and per_rank % nvs:
            self.add(
                "MEG003",
                self.line("--num-virtual-stages-per-pipeline-rank"),
                f"{per_rank} layers per pipeline rank{extra} do not divide into {nvs} virtual stages (get_num_layers_to_build asserts it).",
                f"pick a virtual size dividing {per_rank}, or give --pipeline-model-parallel-layout",
            )

    def uneven_rules(self, L: int, pp: int, first: int | None, last: int | None, nvs: int | None) -> None:
        a = self.a
        vp = nvs if nvs is not None and nvs > 1 else None
        rest, left = L, pp
        for name, val in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
            if not a.has(name) or val is None:
                continue
            if val <= 0:
                self.add("MEG004", a.line(name), f"{name} is {val}; it must be larger than 0.", "give at least one layer, or drop the flag")
            elif vp and val % vp:
                self.add("MEG004", a.line(name), f"{name} {val} is not divisible by the virtual size {vp}.", f"use a multiple of {vp}")
            rest -= val
            left -= 1
        ln = self.line("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
        if left < 0:
            self.add("MEG004", ln, f"first and last stage counts need pp >= 2, got pp = {pp}.", "drop one of the flags")
        elif bool(rest) != bool(left):
            self.add(
                "MEG004",
                ln,
                f"{rest} middle layers remain for {left} middle pipeline stages (num_layers {L}, pp {pp}).",
                "make the first/last counts add up with the middle stages",
            )
        elif left and rest % left:
            self.add(
                "MEG004",
                ln,
                f"{rest} middle layers do not divide over the {left} middle pipeline stages ({rest} = {rest // left} x {left} + {rest % left}).",
                "adjust the first/last counts so the middle layers divide evenly, or use --pipeline-model-parallel-layout",
            )
        elif left and vp and (rest // left) % vp:
            self.add(
                "MEG004",
                ln,
                f"{rest // left} layers per middle pipeline rank are not divisible by the virtual size {vp}.",
                "adjust the counts, or use --pipeline-model-parallel-layout",
            )

    def layout_rules(self, layout: str, L: int, pp: int, uneven: bool, emb: bool, loss: bool) -> None:
        a = self.a
        ln = a.line("--pipeline-model-parallel-layout")
        conflicts = [
            n
            for n, present in (
                ("--decoder-first-pipeline-num-layers", a.has("--decoder-first-pipeline-num-layers")),
                ("--decoder-last-pipeline-num-layers", a.has("--decoder-last-pipeline-num-layers")),
                ("--account-for-embedding-in-pipeline-split", emb),
                ("--account-for-loss-in-pipeline-split", loss),
                ("--num-layers-per-virtual-pipeline-stage", a.has("--num-layers-per-virtual-pipeline-stage")),
                ("--num-virtual-stages-per-pipeline-rank", a.has("--num-virtual-stages-per-pipeline-rank")),
            )
            if present
        ]
        if conflicts:
            self.add(
                "MEG011",
                ln,
                f"--pipeline-model-parallel-layout cannot be combined with {', '.join(conflicts)} (validate_args / TransformerConfig refuse it).",
                "the layout already fixes every stage and the virtual size: drop the other flags",
            )
        try:
            stages = parse_layout(layout)
        except LayoutError as e:
            self.add("MEG006", ln, str(e) + ".", "fix the layout string, e.g. 'Et*3|(t*4|)*6,t*3L'")
            return
        if len(stages) % pp:
            self.add(
                "MEG010",
                ln,
                f"the layout has {len(stages)} stages, not a multiple of pp = {pp} (stage i runs on rank i % pp).",
                f"write pp x vp stages, e.g. {pp} or {2 * pp}",
            )
        flat = [c for st in stages for c in st]
        nt = flat.count("t")
        if nt != L:
            self.add("MEG007", ln, f"the layout places {nt} decoder layers (t) but --num-layers is {L}.", f"make the t count {L}")
        mtp = a.int("--mtp-num-layers") or 0
        nm = flat.count("m")
        if nm != mtp:
            self.add("MEG007", ln, f"the layout places {nm} MTP layers (m) but --mtp-num-layers is {mtp}.", "match the m count to --mtp-num-layers")
        if flat.count("E") != 1 or not stages[0] or stages[0][0] != "E":
            where = [i for i, st in enumerate(stages) if "E" in st]
            self.add(
                "MEG008",
                ln,
                f"E appears {flat.count('E')} time(s) (stages {where}); it must appear once, first in the first stage (Megatron builds the embedding on stage 0).",
                "start the layout with E",
            )
        if flat.count("L") != 1 or not stages[-1] or stages[-1][-1] != "L":
            where = [i for i, st in enumerate(stages) if "L" in st]
            self.add(
                "MEG009",
                ln,
                f"L appears {flat.count('L')} time(s) (stages {where}); it must appear once, last in the last stage (Megatron computes the loss on the last stage).",
                "end the layout with L",
            )

    # attention ----------------------------------------------------------------
    def attention_rules(self, tp: int) -> None:
        a = self.a
        heads = a.int("--num-attention-heads")
        hidden = a.int("--hidden-size")
        if heads is not None and heads > 0 and heads % tp:
            self.add(
                "MEG013",
                self.line("--num-attention-heads", "--tensor-model-parallel-size"),
                f"{heads} attention heads are not divisible by tp = {tp} (TransformerConfig raises ValueError).",
                "choose tp dividing the head count",
            )
        if a.has("--group-query-attention"):
            groups = a.int("--num-query-groups", 1)
            if groups is not None and groups > 0:
                if groups % tp and tp % groups:
                    self.add(
                        "MEG014",
                        self.line("--num-query-groups"),
                        f"{groups} query groups are neither a multiple nor a divisor of tp = {tp} (TransformerConfig raises ValueError).",
                        "choose tp dividing the query groups, or a multiple of them",
                    )
                if heads and heads % groups:
                    self.add(
                        "MEG014",
                        self.line("--num-query-groups"),
                        f"{heads} attention heads are not a multiple of {groups} query groups.",
                        "use a query group count that divides the heads",
                    )
        elif a.has("--num-query-groups"):
            self.add(
                "MEG026",
                a.line("--num-query-groups"),
                f"--num-query-groups {a.value('--num-query-groups')} has no effect without --group-query-attention: Megatron builds {heads or 'all'} key/value heads (multi-head attention).",
                "add --group-query-attention",
            )
        if heads and hidden and not a.has("--kv-channels") and hidden % heads:
            self.add("MEG023", self.line("--hidden-size"), f"hidden size {hidden} is not divisible by {heads} attention heads (validate_args asserts it).", "give --kv-channels, or fix the sizes")
        ffn = a.int("--ffn-hidden-size")
        if ffn is not None and ffn > 0 and ffn % tp:
            self.add("MEG030", self.line("--ffn-hidden-size"), f"FFN hidden size {ffn} is not divisible by tp = {tp} (the MLP's parallel linear layers assert it).", "choose tp dividing the FFN size")

    # batches and schedule -----------------------------------------------------
    def batch_rules(self, tp: int, pp: int, dp: int | None, L: int | None) -> None:
        a = self.a
        mb = a.int("--micro-batch-size")
        gb = a.int("--global-batch-size")
        m = None
        if mb is not None and gb is not None and dp is not None and mb > 0:
            if gb % (mb * dp):
                self.add(
                    "MEG015",
                    self.line("--global-batch-size"),
                    f"global batch {gb} is not divisible by micro batch {mb} x dp {dp} = {mb * dp} (the microbatch calculator asserts it).",
                    f"use a global batch that is a multiple of {mb * dp}",
                )
            else:
                m = gb // (mb * dp)
        vp = _virtual_size(a, L or 0, pp)
        if not vp:
            return
        ln = self.line("--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage")
        no_overlap = a.has("--no-overlap-p2p-communication")
        if pp <= 1 or (no_overlap and pp <= 2):
            need = "> 2 with --no-overlap-p2p-communication" if no_overlap else "> 1"
            self.add(
                "MEG017",
                ln,
                f"the interleaved schedule ({vp} virtual stages per rank) needs pp {need}, got pp = {pp} (validate_args asserts it).",
                "drop the virtual stages, or deepen the pipeline" + (", or drop --no-overlap-p2p-communication" if no_overlap and pp == 2 else ""),
            )
        if m is not None and pp > 1:
            group = a.int("--microbatch-group-size-per-virtual-pipeline-stage") or pp
            if group < pp or group > m:
                self.add(
                    "MEG016",
                    self.line("--global-batch-size", "--microbatch-group-size-per-virtual-pipeline-stage"),
                    f"the interleaved schedule runs micro-batches in groups of {group}, which must lie in [pp, micro-batches] = [{pp}, {m}] (global {gb} / (micro {mb} x dp {dp}) = {m} micro-batches).",
                    f"use at least {max(pp, group)} micro-batches per step (global batch >= {max(pp, group) * (mb or 1) * dp})",
                )
            elif 0 < m % group < pp:
                self.add(
                    "MEG016",
                    self.line("--global-batch-size"),
                    f"{m} micro-batches leave a last group of {m % group} < pp = {pp} (groups of {group}); the interleaved schedule raises RuntimeError (m must be a multiple of pp with the default group size).",
                    f"use a multiple of {group} micro-batches (global batch multiple of {group * (mb or 1) * dp})",
                )

    # misc -----------------------------------------------------------------------
    def misc_rules(self, tp: int, cp: int) -> None:
        a = self.a
        if a.has("--sequence-parallel") and tp == 1:
            self.add("MEG018", a.line("--sequence-parallel"), "--sequence-parallel with tp = 1: validate_args turns it off (with a warning).", "drop --sequence-parallel, or use tp > 1")
        if a.has("--overlap-param-gather"):
            missing = [n for n in ("--use-distributed-optimizer", "--overlap-grad-reduce") if not a.has(n)]
            if "--use-distributed-optimizer" in missing and a.has("--use-megatron-fsdp"):
                missing.remove("--use-distributed-optimizer")
            if missing:
                self.add("MEG019", a.line("--overlap-param-gather"), f"--overlap-param-gather needs {' and '.join(missing)} (validate_args asserts it).", f"add {' '.join(missing)}")
        self.recompute_rules()
        seq = a.int("--seq-length")
        if cp > 1 and seq is not None and seq % (2 * cp):
            self.add("MEG021", self.line("--seq-length", "--context-parallel-size"), f"sequence length {seq} is not a multiple of 2 x cp = {2 * cp}.", f"use a sequence length divisible by {2 * cp}")
        if (tp > 1 or cp > 1) and a.kind == "script" and a.env_value("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            val = a.env_value("CUDA_DEVICE_MAX_CONNECTIONS")
            now = f"it is exported as {val!r}" if val is not None else "it is not exported"
            self.add(
                "MEG022",
                a.launch_line,
                f"tp = {tp}, cp = {cp} need CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment; {now} (validate_args asserts it on GPUs before Blackwell).",
                "add `export CUDA_DEVICE_MAX_CONNECTIONS=1` before the launch",
            )
        heads_pos = a.int("--max-position-embeddings")
        if seq is not None and heads_pos is not None and heads_pos < seq:
            self.add("MEG024", self.line("--max-position-embeddings"), f"--max-position-embeddings {heads_pos} is shorter than --seq-length {seq} (validate_args asserts >=).", f"set --max-position-embeddings to at least {seq}")
        if a.has("--fp16") and a.has("--bf16"):
            self.add("MEG025", self.line("--fp16"), "--fp16 and --bf16 are both given; Megatron trains in one of them.", "keep one")

    def recompute_rules(self) -> None:
        a = self.a
        gran = a.value("--recompute-granularity")
        method = a.value("--recompute-method")
        num = a.get("--recompute-num-layers")
        ln = self.line("--recompute-granularity", "--recompute-activations", "--recompute-method")
        if a.has("--recompute-activations"):
            if gran is not None and gran != "selective":
                self.add("MEG020", ln, f"--recompute-activations means selective recomputation but --recompute-granularity is {gran!r} (validate_args overrides it to selective).", "drop one of them")
            gran = "selective"
        if gran is not None and gran not in ("full", "selective"):
            self.add("MEG020", ln, f"--recompute-granularity {gran!r} is not 'full' or 'selective'.", "use full or selective")
            return
        if method is not None and method not in ("uniform", "block"):
            self.add("MEG020", self.line("--recompute-method"), f"--recompute-method {method!r} is not 'uniform' or 'block'.", "use uniform or block")
        if gran == "full":
            missing = [n for n, present in (("--recompute-method", method is not None), ("--recompute-num-layers", num is not None)) if not present]
            if missing:
                self.add("MEG020", ln, f"full recomputation needs {' and '.join(missing)} (TransformerConfig raises ValueError).", "add --recompute-method uniform --recompute-num-layers 1")
        elif gran == "selective":
            extra = [n for n, present in (("--recompute-method", method is not None), ("--recompute-num-layers", num is not None)) if present]
            if extra:
                self.add("MEG020", ln, f"selective recomputation takes no {' or '.join(extra)} (validate_args / TransformerConfig refuse it).", f"drop {' '.join(extra)}")
        elif method is not None or num is not None:
            self.add("MEG020", self.line("--recompute-method", "--recompute-num-layers"), "--recompute-method/--recompute-num-layers without --recompute-granularity full have no effect.", "add --recompute-granularity full, or drop them")


def check_megatron_args(args: MegatronArgs, world_size: int | None = None) -> list[Finding]:
    """Every rule of :data:`RULES` that ``args`` violates, sorted by rule id then line.

    ``world_size`` (GPUs) defaults to the torchrun world the script states; rules that need it
    (MEG002, MEG015, MEG016) are skipped when neither is known.
    """
    return _Checker(args, world_size).run()


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]
