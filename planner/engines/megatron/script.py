"""The flags a user-written Megatron-LM launch script passes to pretrain_gpt.py, as bash and the launchers see them.

The script is run under bash with stub launchers (planner.launch_capture); the call
that runs a ``pretrain*.py`` script (else any ``*.py``) is the launch. torchrun's own options
are told from the script's by torchrun's own parser (``torch.distributed.run.get_args_parser``),
the script's arguments are grouped by argparse with Megatron's flag table
(planner.engines.megatron.flags.group_argv). Each flag's line is found from bash's xtrace: the command
that last mentioned the flag before the launch, and the nearest line at (or around) it that
writes the flag (a value on that line breaks ties between ``if``/``else`` arms).
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from torch.distributed.run import get_args_parser

from planner.engines.megatron.flags import EnvVar, MegatronArgs, as_int, group_argv, parse_args_file
from planner.launch_capture import STUBS, Call, Capture, run_script
from planner.script_static import read_script

#: variables the capture itself sets, not the script
_OWN_ENV = {"PATH", "HOME", "TMPDIR", "LC_ALL", "BASH_ENV", "PWD", "SHLVL", "OLDPWD", "_"}


class TorchrunRefused(ValueError):
    """torchrun's own parser refuses its arguments (the message is argparse's)."""


def _torchrun(words: Sequence[str]) -> tuple[str | None, list[str], int | None, int | None]:
    """(training script, its arguments, nproc_per_node, nnodes) as torchrun's own parser reads ``words``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            ns = get_args_parser().parse_args(list(words))
        except SystemExit:
            raise TorchrunRefused(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "torchrun's parser stopped") from None
    stated = {w.split("=")[0].replace("_", "-") for w in words}
    if not stated & {"--nproc-per-node", "--nnodes"}:
        return ns.training_script, list(ns.training_script_args), None, None
    low, _, high = str(ns.nnodes).partition(":")
    nproc, nnodes = as_int(str(ns.nproc_per_node)), as_int(low) if not high or high == low else None
    if not nproc or not nnodes or nproc < 1 or nnodes < 1:  # "gpu", "auto", "1:4", "" from a failed $(...): not known statically
        return ns.training_script, list(ns.training_script_args), None, None
    return ns.training_script, list(ns.training_script_args), nproc, nnodes


def _launch(call: Call) -> tuple[str | None, list[str], int | None, int | None]:
    """(script, its arguments, nproc_per_node, nnodes) of one launcher call; script None when it runs no ``*.py``."""
    argv = list(call.argv)
    for k, w in enumerate(argv):
        if Path(w).name == "torchrun":
            return _torchrun(argv[k + 1 :])
        if w in ("torch.distributed.run", "torch.distributed.launch") and k and argv[k - 1] == "-m":
            return _torchrun(argv[k + 1 :])
    for k, w in enumerate(argv[1:], 1):
        if w.endswith(".py") and not w.startswith("-"):
            return w, argv[k + 1 :], None, None
    return None, [], None, None


def _pick(calls: Sequence[Call]) -> tuple[Call, tuple[str | None, list[str], int | None, int | None]] | None:
    """The launch: the first call running a pretrain*.py script, else the first running any *.py script."""
    found = []
    for c in calls:
        try:
            found.append((c, _launch(c)))
        except TorchrunRefused:
            continue
    found = [(c, r) for c, r in found if r[0] is not None and str(r[0]).endswith(".py")]
    preferred = [x for x in found if Path(str(x[1][0])).name.startswith("pretrain")]
    return (preferred or found or [None])[0]


def _written(lines: Sequence[str], word: str) -> list[int]:
    """1-based lines of the script text that contain ``word`` as a whole shell word (quoted or not)."""
    pat = re.compile(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])")
    return [n for n, text in enumerate(lines, 1) if pat.search(text.split("#", 1)[0] if not text.lstrip().startswith("#") else "")]


def _line_of(lines: Sequence[str], trace: Sequence[tuple[str, int, str]], until: int, word: str, value: str | None) -> int | None:
    """Where ``word`` was written: the nearest line at or above the last traced command (up to ``until``) that mentions it."""
    written = _written(lines, word)
    if not written:
        return None
    if value:
        with_value = [n for n in written if value in lines[n - 1]]
        written = with_value or written
    for _, at, text in reversed(trace[: until + 1]):
        if word in text:  # bash's LINENO is the first or the last line of a command that spans several
            above, below = [n for n in written if n <= at], [n for n in written if n > at]
            return above[-1] if above else below[0]
    return written[-1] if len(written) == 1 else None


def _script_trace(capture: Capture, script: str) -> list[tuple[str, int, str]]:
    return [t for t in capture.trace if t[0] == script]


def args_from_capture(capture: Capture, text: str, script_path: str) -> MegatronArgs:
    """MegatronArgs for the launch in ``capture`` (the run of ``text``, at ``script_path``)."""
    picked = _pick(capture.calls)
    if picked is None:
        for call in capture.calls:
            try:
                _launch(call)
            except TorchrunRefused as e:
                words = " ".join(call.argv)
                return MegatronArgs("script", (), stopped=f"torchrun's own parser refuses the launch `{words[:300]}`: {e}")
        reason = capture.stopped or "the script ran to its end without calling torchrun, srun, deepspeed, python or mpirun on a *.py training script."
        return MegatronArgs("script", (), stopped="no launch of a *.py training script was captured: " + reason)
    call, (script, words, nproc, nnodes) = picked
    lines = text.splitlines()
    trace = _script_trace(capture, script_path)
    name = Path(str(script)).name
    launch_at = next((k for k, (_, _, t) in enumerate(trace) if name in t and any(re.search(rf"(^|[\s/]){s}(\s|$)", t) for s in STUBS)), len(trace) - 1)
    launch_line = _line_of(lines, trace, launch_at, call.argv[0], None) or _line_of(lines, trace, launch_at, name, None)
    if launch_line is None and 0 <= launch_at < len(trace):
        launch_line = trace[launch_at][1]
    word_lines: list[int | None] = []
    for k, w in enumerate(words):
        name_, eq, val = w.partition("=")
        value = val if eq else words[k + 1] if k + 1 < len(words) else None
        word_lines.append(_line_of(lines, trace, launch_at, name_, value) if w.startswith("--") else None)
    for k, w in enumerate(words):  # a value sits with its flag
        if word_lines[k] is None:
            word_lines[k] = word_lines[k - 1] if k and word_lines[k - 1] is not None else launch_line
    flags, stray, problems = group_argv(words, word_lines)
    env = tuple(EnvVar(k, v) for k, v in sorted(call.env.items()) if k not in _OWN_ENV and not k.startswith("PLANNER_"))
    return MegatronArgs(
        "script",
        tuple(flags),
        env=env,
        nproc_per_node=nproc,
        nnodes=nnodes,
        launch_line=launch_line,
        script=str(script),
        positionals=tuple(stray),
        words=tuple(words),
        problems=tuple(problems),
        stopped=capture.stopped,
    )


def parse_megatron_args(
    text: str, kind: Literal["script", "args"] = "script", path: Path | None = None, timeout: float | None = None, execute: bool = True
) -> MegatronArgs:
    """The flags a launch script (``kind="script"``) or an args file passes to pretrain_gpt.py.

    A script is run under bash with stub launchers (``execute``; in the sandbox where the platform has one) or read
    without running it (planner.script_static). ``path`` is where the script lives (it is run there, so
    ``source "$(dirname "$0")/env.sh"`` finds its neighbours); without it ``text`` is run from a temporary file.
    """
    if kind == "args":
        return parse_args_file(text)
    if kind != "script":
        raise ValueError(f"kind must be 'script' or 'args', not {kind!r}")
    if not execute:
        where = Path(path).resolve() if path is not None else None
        capture = read_script(where, text)
        return replace(args_from_capture(capture, text, capture.trace[0][0] if capture.trace else str(where or "script.sh")), how=capture.how)
    extra = {} if timeout is None else {"timeout": timeout}
    if path is not None:
        capture = run_script(Path(path).resolve(), **extra)
        return replace(args_from_capture(capture, text, str(Path(path).resolve())), how=capture.how)
    capture = run_script(text=text, **extra)
    scripts = {t[0] for t in capture.trace if t[0].endswith("/script.sh")}
    return replace(args_from_capture(capture, text, next(iter(scripts), "")), how=capture.how)
