"""The flags pretrain_gpt.py receives, as records: grouped by argparse with Megatron-LM's own flag table.

* :class:`MegatronArgs` holds the flags (each with its values and the line it was written on),
  the environment at the launch and the launcher's world size.
* :func:`flag_parser` is an ``argparse.ArgumentParser`` built from
  templates/megatron/flags_core_v0.16.1.tsv (every long option of Megatron-LM core_v0.16.1's
  parser: its nargs and type, ``allow_abbrev=False`` as Megatron sets it); :func:`group_argv`
  lets that parser decide which words belong to which flag.
* :func:`parse_args_file` reads an args file (flags one per line or space separated, ``#`` comments).

Torch-free; no bash here (planner.engines.megatron.script runs launch scripts).
"""

from __future__ import annotations

import argparse
import builtins
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

from planner.resources import templates_dir

MEGATRON_VERSION = "core_v0.16.1"


#: ``--recompute-modules`` choices (TransformerConfig.recompute_modules, core_v0.16.1), in Megatron's order; the
#: default, with ``--recompute-granularity selective``, is core_attn alone
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
#: the modules whose saved bytes and recomputation the planner derives (planner.engines.megatron.activations and
#: megatron_moe_activations); the others are refused rather than priced as if they kept everything
MODELLED_RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "mlp")


@dataclass(frozen=True)
class Flag:
    """One flag as pretrain_gpt.py receives it: ``--name`` and its values (none for a switch), with its source line."""

    name: str
    values: tuple[str, ...]
    line: int | None
    resolved: bool = True  # kept for callers; every value is known once bash has expanded it
    inline: bool = False  # written as --name=value

    @property
    def value(self) -> str | None:
        return self.values[0] if self.values else None


@dataclass(frozen=True)
class EnvVar:
    """An environment variable set at the launch."""

    name: str
    value: str | None
    line: int | None = None


@dataclass(frozen=True)
class MegatronArgs:
    """The flags passed to the training script, the environment at the launch, and the launcher's world size.

    ``problems`` are argparse's own complaints (a value missing, too many values): rule MEG027;
    ``stopped`` says why a launch script did not reach its launch (rule MEG031).
    """

    kind: str
    flags: tuple[Flag, ...]
    env: tuple[EnvVar, ...] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    launch_line: int | None = None
    script: str | None = None  # the training script as the launch names it
    notes: tuple[str, ...] = ()
    positionals: tuple[Flag, ...] = ()  # words that are neither a flag nor a flag's value (argparse refuses them)
    words: tuple[str, ...] = ()  # every argument after the training script
    problems: tuple[Flag, ...] = ()  # (flag, argparse's message as its only value)
    stopped: str | None = None
    #: how a launch script was read (planner.launch_capture.Capture.how): run, or "read" statically
    how: str = ""

    @property
    def world_size(self) -> int | None:
        """nnodes x nproc_per_node when the launcher states them (torchrun's default is 1 for an omitted one)."""
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
        return default if f is None else as_int(f.value)

    def line(self, name: str) -> builtins.int | None:  # builtins: the method int() shadows the type here
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
            out += [f"{f.name}={f.value}"] if f.inline else [f.name, *f.values]
        return out


def as_int(text: str | None) -> int | None:
    """``int(text)`` for a plain decimal integer (what argparse's ``type=int`` accepts, minus ``_`` separators); else None."""
    if text is None or not re.fullmatch(r"\s*[+-]?\d+\s*", text):
        return None
    return int(text)


def as_float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


# --------------------------------------------------------------------------- Megatron's flag table


@dataclass(frozen=True)
class FlagSpec:
    name: str
    nargs: str  # "0" (switch), "1", "3", "+" or "*"
    type: str  # "int", "float", "str" or "-"


@lru_cache(maxsize=1)
def flag_table() -> dict[str, FlagSpec]:
    """Every long option of Megatron-LM core_v0.16.1's argument parser (templates/megatron/flags_core_v0.16.1.tsv)."""
    path = Path(templates_dir()) / "megatron" / f"flags_{MEGATRON_VERSION}.tsv"
    table: dict[str, FlagSpec] = {}
    if not path.is_file():  # an install without the table: unknown-flag and value-type checks are skipped
        return table
    for raw in path.read_text().splitlines():
        if raw and not raw.startswith("#"):
            name, nargs, typ = raw.split("\t")
            table[name] = FlagSpec(name, nargs, typ)
    return table


class _ParseError(Exception):
    def __init__(self, message: str, flag: str | None):
        super().__init__(message)
        self.flag = flag


class _Parser(argparse.ArgumentParser):
    """Raises instead of exiting, so every problem of an argv can be reported."""

    def error(self, message: str) -> NoReturn:
        m = re.match(r"argument (--[\w-]+)", message)
        raise _ParseError(message, m.group(1) if m else None)


class _Record(argparse.Action):
    """Keeps every occurrence of a flag in order (argparse itself keeps only the last value)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: str | Sequence[Any] | None, option_string: str | None = None
    ) -> None:
        vals = [] if values is None else [values] if isinstance(values, str) else list(values)
        namespace.seen.append((option_string, tuple(vals)))


@lru_cache(maxsize=1)
def flag_parser() -> argparse.ArgumentParser:
    """An argparse parser with Megatron's long options, their nargs from the flag table; values kept as strings."""
    parser = _Parser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False)
    for spec in flag_table().values():
        nargs: int | str | None = None if spec.nargs == "1" else int(spec.nargs) if spec.nargs.isdigit() else spec.nargs
        parser.add_argument(spec.name, nargs=nargs, action=_Record, default=argparse.SUPPRESS)
    return parser


def _is_option(word: str) -> bool:
    """Whether argparse would take ``word`` for an option (it starts with '-' and is not a negative number)."""
    return word.startswith("-") and len(word) > 1 and not re.match(r"^-\d+$|^-\d*\.\d+$", word)


def group_argv(argv: Sequence[str], lines: Sequence[int | None] | None = None) -> tuple[list[Flag], list[Flag], list[Flag]]:
    """(flags, stray words, argparse problems) for the arguments after the training script.

    argparse (:func:`flag_parser`) groups the words; a flag it refuses (a value missing, ...) is
    reported in the problems and left out, and the rest parsed again. Words that are not
    Megatron flags: ``--unknown`` with the words after it is a flag the table lacks, any other
    word is stray. ``lines[i]`` is the source line of ``argv[i]``.
    """
    words = list(argv)
    at = list(lines) if lines is not None else [None] * len(words)
    keep = list(range(len(words)))
    problems: list[Flag] = []
    seen: list[tuple[str, tuple[str, ...]]] = []
    parser = flag_parser()
    while True:
        ns = argparse.Namespace(seen=[])
        try:
            parser.parse_known_args([words[i] for i in keep], ns)
            seen = ns.seen
            break
        except _ParseError as e:
            drop = next((i for i in keep if e.flag and (words[i] == e.flag or words[i].startswith(e.flag + "="))), None)
            problems.append(Flag(e.flag or "argv", (str(e),), at[drop] if drop is not None else None))
            if drop is None:
                break
            keep.remove(drop)
    placed: list[tuple[int, Flag]] = []  # (argv index, flag)
    used: set[int] = set()
    pos = 0
    for name, values in seen:
        k = next(j for j in range(pos, len(keep)) if words[keep[j]] == name or words[keep[j]].startswith(name + "="))
        inline = words[keep[k]] != name
        n = 0 if inline else len(values)
        used.update(keep[k : k + 1 + n])
        placed.append((keep[k], Flag(name, values, at[keep[k]], inline=inline)))
        pos = k + 1 + n
    stray: list[Flag] = []
    unknown: tuple[int, Flag] | None = None  # the unknown flag whose values are being collected
    for i in keep:
        if i in used:
            unknown = None
            continue
        w = words[i]
        if w.startswith("--") and len(w) > 2:
            name, eq, val = w.partition("=")
            placed.append((i, Flag(name, (val,) if eq else (), at[i], inline=bool(eq))))
            unknown = None if eq else placed[-1]
        elif unknown is not None and not _is_option(w):
            k = placed.index(unknown)
            placed[k] = unknown = (unknown[0], Flag(unknown[1].name, unknown[1].values + (w,), unknown[1].line))
        else:
            stray.append(Flag(w, (), at[i]))
    return [f for _, f in sorted(placed, key=lambda p: p[0])], stray, problems


def parse_args_file(text: str) -> MegatronArgs:
    """The flags of an args file: words as the shell splits them (quotes kept together), ``#`` comments, each with its line."""
    argv: list[str] = []
    lines: list[int] = []
    for n, raw in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(raw, comments=True)
        except ValueError:  # an unclosed quote: the words as written
            words = raw.split("#", 1)[0].split()
        argv += words
        lines += [n] * len(words)
    flags, stray, problems = group_argv(argv, lines)
    return MegatronArgs("args", tuple(flags), positionals=tuple(stray), words=tuple(argv), problems=tuple(problems))
