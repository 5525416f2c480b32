"""What ``planner validate`` checks of a torchtitan plan directory's launch script: the ``torchtitan.train`` command
line it launches (captured as planner.check.validate.launch_capture captures any launch script: run when rendered and
unchanged, read statically otherwise), against plan.json (TT001: each planned override present with its planned
value, the processes torchrun starts equal to the plan's GPUs), and by torchtitan's own ``ConfigManager`` where it
imports (TT003; torchtitan 0.3.0's llama3 registry imports triton kernels, so on a CPU-only torch it does not, and
the check says it was skipped).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

from planner.check.validate import _Ctx, _Run, display, launch_capture
from planner.engines.torchtitan.render import CONFIG_MODULE, overrides

FILE_KINDS = ("torchtitan-launch",)
FILE_WHAT = "torchtitan launch script (launch_torchtitan.sh)"
RULES: dict[str, tuple[str, str]] = {
    "TT001": ("error", "the torchtitan command line disagrees with plan.json"),
    "TT002": ("error", "no launch of torchtitan.train was found"),
    "TT003": ("error", "torchtitan's own config parser refuses the command line"),
    "TT004": ("info", "torchtitan's own config parser was not run"),
}
#: whether :func:`check` re-estimates the memory of what the file runs (else validate estimates plan.json's layout)
CHECKS_MEMORY = False
__all__ = ["CHECKS_MEMORY", "FILE_KINDS", "FILE_WHAT", "RULES", "check", "classify"]

_MARK = re.compile(r"(?:-m\s+|/)torchtitan[./]train\b")


def classify(path: Path, text: str) -> str | None:
    """'torchtitan-launch' for a shell script that starts ``torchtitan.train``."""
    if path.suffix.lower() in (".sh", ".bash", "") and _MARK.search(text):
        return "torchtitan-launch"
    return None


def _trainer_words(argv: tuple[str, ...]) -> list[str] | None:
    """The words after ``-m torchtitan.train`` (or a torchtitan/train.py script) in a launcher's argv; None if absent."""
    for k, w in enumerate(argv):
        if w == "torchtitan.train" and k and argv[k - 1] == "-m":
            return list(argv[k + 1 :])
        if w.endswith("torchtitan/train.py"):
            return list(argv[k + 1 :])
    return None


def options(words: list[str]) -> dict[str, list[str]]:
    """``--flag value ...`` words as {flag: values} (the last occurrence wins, as tyro's does), a tyro subcommand
    (``activation-checkpoint:full``) as {its field: [its choice]}."""
    out: dict[str, list[str]] = {}
    flag: str | None = None
    for w in words:
        if w.startswith("--"):
            flag = w.split("=", 1)[0]
            out[flag] = [w.split("=", 1)[1]] if "=" in w else []
        elif ":" in w and not w.startswith("-") and re.fullmatch(r"[a-z][\w.-]*:[\w-]+", w):
            field, _, choice = w.partition(":")
            out[field] = [choice]
            flag = None
        elif flag is not None:
            out[flag].append(w)
    return out


def _world(argv: tuple[str, ...]) -> int | None:
    """nnodes x nproc-per-node of a torchrun argv, when both are plain integers."""
    got: dict[str, int] = {}
    for k, w in enumerate(argv):
        name, eq, val = w.partition("=")
        name = name.replace("_", "-")
        if name in ("--nnodes", "--nproc-per-node"):
            value = val if eq else (argv[k + 1] if k + 1 < len(argv) else "")
            if value.isdigit():
                got[name] = int(value)
    return got["--nnodes"] * got["--nproc-per-node"] if len(got) == 2 else None


def check(run: _Run, ctx: _Ctx, path: Path, kind: str) -> None:
    rel = display(path)
    capture = launch_capture(run, path)
    launches = [(c, w) for c in capture.calls for w in [_trainer_words(c.argv)] if w is not None]
    if not launches:
        why = capture.stopped or "the script ran to its end without calling torchrun on torchtitan.train"
        run.add("TT002", rel, None, f"no launch of torchtitan.train was found: {why}.", "launch `torchrun ... -m torchtitan.train --module ... --config ...`")
        return
    call, words = launches[0]
    have = options(words)
    if ctx.plan is not None:
        lay = ctx.plan.layout
        for flag, want in options(overrides(ctx.plan)).items():
            got = have.get(flag)
            if got != want:
                shown = "absent" if got is None else " ".join(got) or "(no value)"
                run.add(
                    "TT001",
                    rel,
                    None,
                    f"{flag} is {shown} but the plan renders {' '.join(want) or '(the switch)'}. The script no longer is the plan.",
                    "re-run `planner plan` to regenerate both, or put back the planned value",
                )
        world = _world(call.argv)
        if world is not None and world != lay.world:
            run.add("TT001", rel, None, f"torchrun starts {world} processes but plan.json places {lay.world} GPUs.", "re-plan for this cluster")
    _torchtitan_parse(run, rel, have, words)


def _config_manager() -> Any:
    """torchtitan's ConfigManager with its llama3 registry, or None where they do not import (no torchtitan, or a torch
    without triton: 0.3.0's llama3 registry imports its MoE dispatcher's triton kernels)."""
    try:
        import torchtitan.models.llama3.config_registry  # noqa: F401
        from torchtitan.config.manager import ConfigManager
    except Exception:  # noqa: BLE001 - a missing optional dependency means the parser is not available
        return None
    return ConfigManager


def _torchtitan_parse(run: _Run, rel: str, have: dict[str, list[str]], words: list[str]) -> None:
    manager = _config_manager()
    if manager is None:
        run.add(
            "TT004",
            rel,
            None,
            "torchtitan's ConfigManager was not run: torchtitan 0.3.0's llama3 registry does not import here (it needs triton, "
            "which a CPU-only torch lacks); the planned overrides were compared with plan.json instead.",
            "run validate where torchtitan imports (a CUDA build of torch) to have its own parser check the command line",
        )
        return
    module = given_module = (have.get("--module") or ["llama3"])[0]
    config = given_config = (have.get("--config") or ["llama3_debugmodel"])[0]
    if module.startswith("$") or config.startswith("$"):
        module, config = "llama3", "llama3_debugmodel"
    elif module == CONFIG_MODULE:
        # the rendered Float8 module wraps a llama3 function (its text is checked for drift with the other files):
        # parse the overrides against that function, since building the Float8 converter needs FP8 hardware
        module, config = "llama3", config.removesuffix("_float8")
    rest = [w for w in words if not w.startswith("$")]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            manager().parse_args(["--module", module, "--config", config, *[w for w in rest if w not in ("--module", "--config", given_module, given_config)]])
    except (SystemExit, Exception) as e:  # noqa: BLE001 - any refusal of torchtitan's parser is the finding
        said = (err.getvalue().strip().splitlines() or [str(e) or type(e).__name__])[-1]
        run.add("TT003", rel, None, f"torchtitan's ConfigManager refuses the command line: {said}", "fix the flag it names, or re-run `planner plan`")
