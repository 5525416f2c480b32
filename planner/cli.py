"""The `planner` command line: parses flags, calls the pure functions, prints with rich.

This is the only module that prints. Errors the user can fix are PlannerError
subclasses: they print as one paragraph and exit with their code (2 for bad
input, 1 for a request with no answer), never as a traceback.
"""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from planner import __version__, hardware
from planner import cli_values as cv
from planner.engines import ENGINES, get_engine
from planner.errors import PlannerError, UsageError
from planner.fileio import MAX_INPUT_BYTES
from planner.hardware.profiles import profile_scan_notes
from planner.model.guard import DEFAULT_TIMEOUT_S, Guard, guard_user_code, stdout_to_stderr

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Plan pipeline-parallel training for a PyTorch model and write the configs to run it.",
    pretty_exceptions_enable=False,
)
hardware_app = typer.Typer(no_args_is_help=True, help="List and show hardware profiles.")
app.add_typer(hardware_app, name="hardware")

# markup=False: user text (paths, model args, device names, exception messages) is printed literally
out = Console(highlight=False, soft_wrap=False, markup=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


def _styled(style: str, label: str, rest: str) -> Text:
    t = Text()
    t.append(label, style=style)
    t.append(rest)
    return t


def _fail(e: PlannerError) -> None:
    err.print(_styled("bold red", "error:", f" {e.message}"))
    if e.hint:
        err.print(e.hint)
    raise typer.Exit(e.exit_code)


@contextmanager
def _errors() -> Iterator[None]:
    """PlannerErrors, and the operating system's refusals (disk full, read-only, permission), as one paragraph."""
    try:
        yield
    except PlannerError as e:
        _fail(e)
    except OSError as e:
        where = f" {e.filename!s}" if e.filename else ""
        _fail(UsageError(f"cannot write or read{where}: {e.strerror or e}.", "Check the path, its permissions and the free disk space."))
    except RecursionError:
        _fail(UsageError("an input is nested too deeply to read.", "Check the files and values you passed."))
    except UnicodeDecodeError as e:
        _fail(UsageError(f"an input file is not UTF-8 text ({e.reason} at byte {e.start})."))


@contextmanager
def _user_code(model: Path, timeout_s: float | None, initial_phase: str = "import") -> Iterator[Guard]:
    """Run the body as the model file's code: exits and hangs become errors; its prints go to stderr."""
    with guard_user_code(str(model.name or model), timeout_s) as g, stdout_to_stderr():
        g.phase = initial_phase
        yield g


@contextmanager
def progress_reporter(enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A callback(phase, done, total) that shows a progress bar once work has lasted over a second."""
    if not enabled or not err.is_terminal:
        yield None
        return
    start = time.monotonic()
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=err, transient=True)
    tasks: dict[str, int] = {}
    shown = False

    def report(phase: str, done: int, total: int) -> None:
        nonlocal shown
        if not shown and time.monotonic() - start > 1.0:
            bar.start()
            shown = True
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=max(total, 1))
        bar.update(tasks[phase], completed=done, total=max(total, 1))

    try:
        yield report
    finally:
        if shown:
            bar.stop()


def human_bytes(x: float) -> str:
    """Bytes in binary units: 512 B, 4.0 KiB, 12.3 MiB, 1.50 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}" if unit in ("GiB", "TiB") else f"{x / scale:,.1f} {unit}"
    return f"{x:,.0f} B"


def human_flops(x: float) -> str:
    """FLOPs in decimal units: 12.3 M, 4.56 G, 1.23 T."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f}"


ModelArg = typer.Option(None, "--model-arg", help="KEY=VALUE passed to the model file's functions (repeatable).")
Leaf = typer.Option(None, "--leaf", help="Class name to keep as one piece (repeatable).")
Timeout = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Seconds allowed for importing, building, tracing and costing the model (0: no limit).")


def _timeout(value: float) -> float | None:
    """--timeout: 0 means no limit; otherwise a finite number of seconds up to a week."""
    if value == 0:
        return None
    return cv.finite_number("--timeout", value, 0.0, cv.MAX_TIMEOUT_S)


#: longest --model-arg accepted (characters); values are Python literals, not data files
MAX_MODEL_ARG_CHARS = 4096


def _model_args(pairs: Optional[List[str]]) -> dict[str, Any]:
    """--model-arg KEY=VALUE pairs, bounded in length; a literal too deep to parse is an exit-2 error."""
    from planner.model.args import parse_model_args

    for pair in pairs or ():
        if len(pair) > MAX_MODEL_ARG_CHARS:
            raise UsageError(f"--model-arg {pair[:40]!r}... is {len(pair):,} characters; the limit is {MAX_MODEL_ARG_CHARS:,}.")
    try:
        return parse_model_args(pairs)
    except (RecursionError, MemoryError):
        raise UsageError("a --model-arg value nests too deeply to read.", "Pass plain numbers, strings, lists or dicts.") from None


@app.command()
def inspect(
    model: Path = typer.Argument(..., help="Model file defining build_model() and example_inputs(), or hf:CONFIG.json, timm:NAME, torchvision:NAME."),
    micro_batch: int = typer.Option(1, "--micro-batch", "-b", help="Samples per micro-batch."),
    model_arg: Optional[List[str]] = ModelArg,
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 | fp16 | fp32"),
    leaf: Optional[List[str]] = Leaf,
    tracer: str = typer.Option("auto", "--tracer", help="auto | fx | export"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    timeout: float = Timeout,
) -> None:
    """Show what every piece of the model costs: FLOPs, parameters, saved activations, cut bytes."""
    from planner.model.analyze import analyze

    with _errors():
        cv.positive_int("--micro-batch", micro_batch)
        cv.choice("--dtype", dtype, cv.DTYPES)
        cv.choice("--tracer", tracer, cv.TRACERS)
        limit = _timeout(timeout)
        args = _model_args(model_arg)
        with progress_reporter(not as_json) as report, _user_code(model, limit) as g:
            a = analyze(model, args, micro_batch, dtype, leaf, tracer, progress=g.wrap(report))
    c = a.costs
    totals = {
        "params": c.total_params,
        "flops_fwd": sum(l.flops_fwd for l in c.layers),
        "flops_bwd": sum(l.flops_bwd for l in c.layers),
        "saved_bytes": sum(l.saved_bytes for l in c.layers),
        "layers": c.n,
        "tracer": a.layer_graph.tracer,
        "micro_batch": c.micro_batch,
        "dtype": c.dtype,
        "seq_len": c.seq_len,
    }
    if as_json:
        doc = {
            "layers": [l.to_dict() for l in c.layers],
            "cuts": [x.to_dict() for x in c.cuts[1:-1]],
            "totals": totals,
            "tied": [g.to_dict() for g in c.tied],
            "notes": list(c.notes),
        }
        stdout().write(json.dumps(doc, indent=2) + "\n")
        return
    table = Table(title=f"{model.name}: {c.n} pieces, micro-batch {c.micro_batch}, {c.dtype}", show_lines=False)
    for col, just in [
        ("#", "right"),
        ("layer", "left"),
        ("kind", "left"),
        ("params", "right"),
        ("fwd FLOP", "right"),
        ("bwd FLOP", "right"),
        ("saved", "right"),
        ("out", "right"),
        ("cut after", "right"),
    ]:
        table.add_column(col, justify=just)
    for i, l in enumerate(c.layers):
        cut = c.cuts[i + 1].bytes if i + 1 < c.n else 0
        table.add_row(
            str(i),
            l.name,
            l.kind,
            f"{l.params:,}",
            human_flops(l.flops_fwd),
            human_flops(l.flops_bwd),
            human_bytes(l.saved_bytes),
            human_bytes(l.out_bytes),
            human_bytes(cut) if i + 1 < c.n else "",
        )
    table.add_section()
    table.add_row(
        "", "total", "", f"{c.total_params:,}", human_flops(totals["flops_fwd"]), human_flops(totals["flops_bwd"]), human_bytes(totals["saved_bytes"]), "", ""
    )
    out.print(table)
    for g in c.tied:
        out.print(f"tied: {g.name} ({g.params:,} params) is shared by pieces {', '.join(map(str, g.layers))}; counted once in the total")
    for note in c.notes:
        out.print(f"note: {note}")
    out.print(
        f"traced with {a.layer_graph.tracer}; saved = activation bytes kept for backward per micro-batch; cut after = bytes crossing the cut after the piece (skip connections included)"
    )


def _check_pins(engine: str, pp, tp, dp, vp, micro_batch, global_batch, schedule, recompute, zero, mem_target) -> None:
    """Every pin in range and, for names, one the engine accepts (exit 2 listing what is accepted)."""
    cv.choice("--engine", engine, tuple(ENGINES))
    for flag, value in (("--pp", pp), ("--tp", tp), ("--dp", dp), ("--vp", vp), ("--micro-batch", micro_batch)):
        cv.positive_int(flag, value)
    cv.positive_int("--global-batch", global_batch, cv.MAX_GLOBAL_BATCH)
    cv.finite_number("--mem-target", mem_target, 0.0, 1.0)
    eng = get_engine(engine)
    cv.choice("--schedule", schedule, eng.schedules)
    cv.choice("--recompute", recompute, eng.recompute_modes)
    cv.choice("--zero", zero, eng.zero_levels)


#: the typer annotation of a settings field's type (planner.solve.settings declares each field's type as text)
_CLI_TYPES: dict[str, Any] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "str | None": Optional[str],
    "int | None": Optional[int],
    "float | None": Optional[float],
    "bool | None": Optional[bool],
    "tuple[str, ...]": Optional[List[str]],
    "dict[str, Any]": Optional[List[str]],
}
#: settings fields whose command-line form differs from the record's: (typer annotation, record value from the option)
_CLI_FORMS: dict[str, tuple[Any, Callable[[Any], Any]]] = {
    "model_file": (Path, str),
    "model_args": (Optional[List[str]], lambda v: _model_args(v)),
    "leaf": (Optional[List[str]], lambda v: tuple(v or ())),
    "hardware_profiles": (Optional[List[Path]], lambda v: tuple(str(p) for p in v or ())),
    "profile": (Optional[Path], lambda v: str(v) if v else None),
    "recompute_modules": (Optional[List[str]], lambda v: v),  # parsed with the engine: cli_values.recompute_modules
}
#: settings fields `planner plan` requires although the record has a default (the search alone needs neither)
_CLI_REQUIRED = ("model_file", "gpus")


def _settings_options() -> list[Any]:
    """One typer parameter per field of the settings record that `planner plan` takes (planner.solve.settings: its
    flag, default and help), each in the help panel of its section; the model file first, as the argument."""
    import dataclasses
    import inspect as _inspect

    from planner.solve.settings import SECTIONS, Settings

    engine_field = next(f for f in dataclasses.fields(Settings) if f.name == "engine")
    listed: list[tuple[str, Any]] = [("Engine", engine_field)]
    listed += [(section.title(), f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.metadata["cli"]]
    params = []
    for panel, f in listed:
        meta = f.metadata
        annotation, _ = _CLI_FORMS.get(f.name, (_CLI_TYPES[str(f.type)], None))
        help_text = meta["help"] if f.name != "engine" else " | ".join(ENGINES)
        default = ... if f.name in _CLI_REQUIRED else (None if f.name in _CLI_FORMS and f.name != "model_file" else f.default)
        if meta["flag"] == "MODEL":
            option = typer.Argument(..., help=help_text)
        else:
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            if str(f.type) == "bool | None" or (str(f.type) == "bool" and f.default is True):
                flag = f"{flag}/--no-{flag[2:]}"
            option = typer.Option(default, flag, help=help_text, rich_help_panel=panel)
        name = "model" if meta["flag"] == "MODEL" else f.name
        params.append(_inspect.Parameter(name, _inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def _settings_from_options(given: dict[str, Any]) -> dict[str, Any]:
    """The settings record's fields from `planner plan`'s options (flat names; the argument ``model`` is
    ``model_file``), in the record's own forms."""
    named = {("model_file" if name == "model" else name): value for name, value in given.items()}
    return {name: _CLI_FORMS[name][1](value) if name in _CLI_FORMS else value for name, value in named.items()}


def plan(
    out_dir: Optional[Path] = typer.Option(
        None, "--out", help="Write plan.json, the engine's configs and launch scripts, and the report here (other files there are kept)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print plan.json to stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the one-line layout."),
    force: bool = typer.Option(False, "--force", help="Replace files in --out that the planner did not write."),
    timeout: float = Timeout,
    **given: Any,
) -> None:
    """Choose the layout and stage split, predict step time and memory, and write the configs.

    The options after the first five are the settings record's (planner.solve.settings), one per field."""
    from planner.planning import plan_model
    from planner.solve.settings import Settings

    with _errors():
        v = given
        _check_pins(
            v["engine"], v["pp"], v["tp"], v["dp"], v["vp"], v["micro_batch"], v["global_batch"], v["schedule"], v["recompute"], v["zero"], v["mem_target"]
        )
        cv.choice("--dtype", v["dtype"], cv.PLAN_DTYPES)
        cv.choice("--tracer", v["tracer"], cv.TRACERS)
        modules = cv.recompute_modules(v["recompute_modules"], v["recompute"], v["engine"])
        limit = _timeout(timeout)
        values = _settings_from_options(given)
        values.update(recompute_modules=modules, recompute="selective" if modules else v["recompute"])
        req = Settings.of(**values)
        cv.positive_int("--cp", v["cp"])
        eng = get_engine(v["engine"])
        if v["cp_comm"] is not None and not eng.context_parallel:
            raise UsageError(
                f"engine {eng.name} runs no context parallelism (--cp-comm-type {v['cp_comm']}).",
                f"Use {eng.alternative(lambda e: e.context_parallel)}, or drop --cp-comm-type.",
            )
        cv.choice("--cp-comm-type", v["cp_comm"], eng.cp_comm_types)
        cv.positive_int("--microbatch-group", v["microbatch_group"], cv.MAX_GLOBAL_BATCH)
        if v["loss_chunks"]:
            cv.positive_int("--loss-chunks", v["loss_chunks"], cv.MAX_GLOBAL_BATCH)
        cv.fp8_param_gather(v["fp8_param_gather"], v["dtype"], v["engine"], v["zero"])
        cv.positive_int("--ep", v["ep"])
        cv.positive_int("--etp", v["etp"])
        cv.choice("--main-grads-dtype", v["main_grads_dtype"], ("fp32", "bf16"))
        cv.choice("--optimizer-state-dtype", v["optimizer_state_dtype"], ("fp32", "bf16", "fp16"))
        if out_dir is not None:
            from planner.render import check_output_dir

            check_output_dir(out_dir, force)
        with progress_reporter(not (as_json or quiet)) as report, _user_code(Path(req.model.model_file), limit) as g:
            the_plan, analysis, result = plan_model(req, progress=g.wrap(report))
        notes: list[str] = []
        if out_dir is not None:
            from planner.render import write_plan_dir

            notes = write_plan_dir(out_dir, the_plan, force=force)
    for note in notes:
        err.print(f"note: {note}")
    doc = the_plan.to_dict()
    if as_json:
        from planner.fileio import dumps_json

        stdout().write(dumps_json(doc))
        return
    if quiet:
        out.print(the_plan.layout.short())
        return
    from planner.report import print_summary

    print_summary(out, the_plan, result)
    if out_dir is not None:
        out.print(f"wrote {out_dir}/ (plan.json and the {req.engine} files)")


def _with_settings_signature(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` as typer sees it: the settings options first (the model argument leading), then its own."""
    import inspect as _inspect

    own = [p for p in _inspect.signature(command).parameters.values() if p.kind is not _inspect.Parameter.VAR_KEYWORD]
    own = [p.replace(kind=_inspect.Parameter.KEYWORD_ONLY, annotation=_OWN_TYPES[p.name]) for p in own]
    command.__signature__ = _inspect.Signature(_settings_options() + own)  # type: ignore[attr-defined]
    return command


#: the annotations of plan's own options (the module's annotations are text under ``from __future__ import annotations``)
_OWN_TYPES: dict[str, Any] = {"out_dir": Optional[Path], "as_json": bool, "quiet": bool, "force": bool, "timeout": float}
app.command(name="plan")(_with_settings_signature(plan))


def _hardware_profiles(paths: Optional[List[Path]]):
    return hardware.available_profiles(paths or ())


@hardware_app.command("list")
def hardware_list(hardware_profile: Optional[List[Path]] = typer.Option(None, "--hardware-profile", help="Extra profile file or folder.")) -> None:
    """List the known devices."""

    with _errors():
        profiles = _hardware_profiles(hardware_profile)
        rows = hardware.profiles_table_rows(profiles)
    table = Table(title="hardware profiles")
    for col in rows[0].keys() if rows else []:
        table.add_column(col)
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    out.print(table)
    for note in profile_scan_notes(hardware_profile or ()):
        err.print(f"note: {note}")


@hardware_app.command("show")
def hardware_show(name: str, hardware_profile: Optional[List[Path]] = typer.Option(None, "--hardware-profile")) -> None:
    """Show one device profile with the source of every number."""
    with _errors():
        profiles = _hardware_profiles(hardware_profile)
        prof, note = hardware.resolve_device(name, profiles)
        rows = hardware.describe_profile(prof)
    if note:
        err.print(f"note: {note}")
    table = Table(title=f"{prof.name} ({prof.key})")
    for col in ("field", "value", "source"):
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    out.print(table)


@app.command()
def profile(
    model: Path = typer.Argument(..., help="Model file defining build_model() and example_inputs(), or hf:CONFIG.json, timm:NAME, torchvision:NAME."),
    device: str = typer.Option("cuda", "--device", help="cuda | cpu"),
    out_path: Path = typer.Option(Path("profile.json"), "--out", "-o", help="Where to write the profile."),
    micro_batch: int = typer.Option(1, "--micro-batch", "-b", help="Samples per micro-batch (profile at the planned one)."),
    model_arg: Optional[List[str]] = ModelArg,
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 | fp16 | fp32 (default bf16 on cuda, fp32 on cpu)"),
    leaf: Optional[List[str]] = Leaf,
    tracer: str = typer.Option("auto", "--tracer", help="auto | fx | export"),
    warmup: int = typer.Option(3, "--warmup", help="Warm-up runs per piece."),
    repeats: int = typer.Option(10, "--repeats", help="Timed runs per piece (median and spread are recorded)."),
    calibrate: bool = typer.Option(False, "--calibrate", help="Also measure matmul FLOP/s and memory bandwidth and write a hardware profile."),
    hardware_out: Optional[Path] = typer.Option(None, "--hardware-out", help="Where --calibrate writes the hardware profile YAML."),
    timeout: float = Timeout,
) -> None:
    """Measure every distinct piece's forward and backward time on this machine's device (for `plan --profile`)."""
    from planner.fileio import write_text_atomic
    from planner.hardware.calibrated import profile_to_hardware_yaml, suggested_hardware_key
    from planner.model.profile import profile_model, write_profile

    with _errors():
        cv.choice("--device", device, cv.PROFILE_DEVICES)
        cv.choice("--dtype", dtype, cv.DTYPES)
        cv.choice("--tracer", tracer, cv.TRACERS)
        cv.positive_int("--micro-batch", micro_batch)
        cv.non_negative_int("--warmup", warmup, 10_000)
        cv.positive_int("--repeats", repeats, 10_000)
        limit = _timeout(timeout)
        if hardware_out is not None and not calibrate:
            raise UsageError("--hardware-out needs --calibrate (the hardware profile comes from the calibration).")
        args = _model_args(model_arg)
        with progress_reporter(True) as report, _user_code(model, limit) as g:
            doc = profile_model(
                model, args, device, micro_batch, dtype, leaf, tracer, warmup=warmup, repeats=repeats, calibrate=calibrate, progress=g.wrap(report)
            )
        write_profile(out_path, doc)
        hw_path = None
        if calibrate:
            hw_path = hardware_out or out_path.with_name(suggested_hardware_key(doc) + ".yaml")
            write_text_atomic(hw_path, profile_to_hardware_yaml(doc))
    table = Table(title=f"{model.name} on {doc['device']['name']} ({doc['dtype']}, micro-batch {doc['micro_batch']})")
    for col, just in (
        ("#", "right"),
        ("piece", "left"),
        ("same as", "right"),
        ("fwd ms [min-max]", "right"),
        ("bwd ms [min-max]", "right"),
        ("peak MiB", "right"),
    ):
        table.add_column(col, justify=just)
    for p in doc["pieces"]:
        f, b = p.get("fwd_s"), p.get("bwd_s")
        span = lambda x: f"{x['median'] * 1e3:.3f} [{x['min'] * 1e3:.3f}-{x['max'] * 1e3:.3f}]" if x else ""
        peak = p.get("peak_bytes")
        table.add_row(
            str(p["index"]), p["name"], "" if p.get("same_as") is None else str(p["same_as"]), span(f), span(b), f"{peak / 2**20:,.1f}" if peak else ""
        )
    out.print(table)
    out.print(f"wrote {out_path}" + (f" and {hw_path}" if hw_path else ""))


@app.command()
def smoke(
    plan_dir: Path = typer.Argument(..., help="A plan directory written by `planner plan --out`."),
    steps: int = typer.Option(3, "--steps", help="Training steps to run."),
    ranks: Optional[int] = typer.Option(None, "--ranks", help="Processes to launch (default: the plan's, up to 4 on CPU or the visible GPUs)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds before the run is declared hung and killed."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    model_arg: Optional[List[str]] = typer.Option(None, "--model-arg", help="Scale the model down, e.g. --model-arg dim=256 (recorded in smoke.json)."),
    tolerance: float = typer.Option(1e-5, "--tolerance", help="Relative loss difference allowed against the single-process run (fp32)."),
    megatron_path: Optional[Path] = typer.Option(None, "--megatron-path", help="Megatron-LM checkout (GPU machines) to run pretrain_gpt.py."),
    keep: bool = typer.Option(False, "--keep", help="Keep the scaled plan and the per-rank logs (their path is printed)."),
) -> None:
    """Run a rendered plan for real at a scale this machine can run, and check it computes what a single process does."""
    from planner.check.smoke import smoke as run_smoke

    with _errors():
        cv.choice("--device", device, cv.SMOKE_DEVICES)
        cv.positive_int("--steps", steps, 1_000_000)
        cv.positive_int("--ranks", ranks, cv.MAX_DEGREE)
        cv.finite_number("--timeout", timeout, 0.0, cv.MAX_TIMEOUT_S)
        cv.finite_number("--tolerance", tolerance, 0.0, 1e6, low_open=False)
        args = _model_args(model_arg)
        # the ranks run in their own processes under --timeout; in this process only exits are guarded
        with _user_code(Path("the model file"), None, initial_phase="smoke run"):
            result = run_smoke(plan_dir, steps, ranks, timeout, device, args, tolerance, str(megatron_path) if megatron_path else None, keep=keep)
    lay = result.layout
    out.print(
        _styled(
            "bold",
            "smoke",
            f" {result.engine} on {result.ranks} {result.device} rank(s): pp{lay['pp']} dp{lay['dp']} v{lay['vp']} {lay['schedule']} mb{lay['micro_batch']}x{lay['num_microbatches']}, {result.steps} steps",
        )
    )
    for note in result.scale_down:
        out.print(f"  scaled down: {note}")
    if result.loss:
        out.print(f"  loss trained: {result.loss}")
    for c in result.checks:
        first, *rest = c.detail.splitlines() or [""]
        out.print(_styled("green" if c.ok else "red", "ok  " if c.ok else "FAIL", f" {c.name}: {first}"))
        for line in rest:
            out.print(f"       {line}")
    if result.kept:
        out.print(f"kept the scaled plan and logs in {result.kept}")
    out.print(f"wrote {plan_dir / 'smoke.json'}")
    raise typer.Exit(0 if result.ok else 1)


@app.command(context_settings={"ignore_unknown_options": True})
def calibrate(
    runs: Optional[List[str]] = typer.Argument(
        None,
        metavar="RUN... [--log FILE PLAN_DIR]...",
        help="Plan directories holding a smoke.json, and/or --log FILE PLAN_DIR pairs (a Megatron-LM or DeepSpeed log and the plan directory of that run).",
    ),
    name: str = typer.Option(..., "--name", help="Name of the calibrated device: use it as --gpus 8xNAME."),
    out_file: Path = typer.Option(..., "--out", help="Where to write the hardware profile YAML (its stem is the profile key)."),
    base: Optional[str] = typer.Option(None, "--base", help="Profile to start from (default: the device the runs were planned for)."),
    hardware_profile: Optional[List[Path]] = typer.Option(None, "--hardware-profile", help="Extra hardware profile YAML (file or folder)."),
) -> None:
    """Fit the time model to measured runs and write a hardware profile that predicts them."""
    from planner.check.calibrate import calibrate as run_calibrate
    from planner.check.calibrate import parse_run_args

    with _errors():
        run_dirs, logs = parse_run_args(runs or [])
        result = run_calibrate(run_dirs, logs, name, out_file, base, [str(p) for p in hardware_profile or ()])
    table = Table(title=f"step time: measured vs predicted ({len(result.rows)} run(s), base profile {result.fit.base.key})")
    for col, just in (
        ("run", "left"),
        ("layout", "left"),
        ("measured", "right"),
        ("base profile", "right"),
        ("error", "right"),
        ("calibrated", "right"),
        ("error ", "right"),
    ):
        table.add_column(col, justify=just)
    for r in result.rows:
        table.add_row(
            r.run,
            r.layout,
            f"{r.measured_s:.4g} s",
            f"{r.before_s:.4g} s",
            f"{r.before_s / r.measured_s - 1:+.1%}",
            f"{r.after_s:.4g} s",
            f"{r.after_s / r.measured_s - 1:+.1%}",
        )
    out.print(table)
    if result.memory:
        mt = Table(title="peak memory per pipeline rank")
        for col in ("run", "rank", "allocated (measured)", "tensors (predicted)", "reserved (measured)", "with reserve (predicted)"):
            mt.add_column(col, justify="left" if col == "run" else "right")
        for m in result.memory:
            mt.add_row(
                m.run,
                str(m.pipe_rank),
                human_bytes(m.measured_allocated) if m.measured_allocated else "-",
                human_bytes(m.predicted_tensors),
                human_bytes(m.measured_reserved) if m.measured_reserved else "-",
                human_bytes(m.predicted_total),
            )
        out.print(mt)
    from planner.check.calibrate import BY_ATTR

    for attr, status in result.fit.status.items():
        p = BY_ATTR[attr]
        if status != "not identified":
            out.print(f"fitted {p.field} ({p.what}): {status}")
    for k in result.kept:
        out.print(f"kept from the base profile: {k}")
    for k in result.not_modelled:
        out.print(f"not in the time model: {k}")
    for n in result.notes:
        out.print(f"note: {n}")
    out.print(f"wrote {out_file} (use: --hardware-profile {out_file} --gpus 8x{name})")


#: suffixes of the files `validate` and `explain` may read inside a directory
_READ_SUFFIXES = (".json", ".sh", ".yaml", ".yml", ".txt", ".args")


def _check_inputs(paths: List[Path]) -> None:
    """Files the checks will read are regular and at most fileio.MAX_INPUT_BYTES (a FIFO would block the read,
    a 200 MB config would take minutes): exit 2 naming the file, before anything is read."""
    candidates: list[Path] = []
    for p in paths:
        if p.is_dir():
            candidates += [c for c in sorted(p.iterdir()) if c.suffix in _READ_SUFFIXES]
        else:
            candidates.append(p)
    for c in candidates:
        try:
            st = c.stat()
        except OSError:
            continue  # missing or a dangling link: the check itself reports it
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{str(c)!r} is not a regular file (a pipe, socket or device); it is not read.", "Remove it or name regular files.")
        if st.st_size > MAX_INPUT_BYTES:
            raise UsageError(f"{str(c)!r} is {st.st_size:,} bytes; configs and plans are read up to {MAX_INPUT_BYTES:,} bytes.")


@app.command()
def validate(
    paths: List[Path] = typer.Argument(..., help="Plan directories or single files (ds_config JSON, Megatron launch script or args file, plan.json)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="Cluster the configs will run on (default: the one recorded in plan.json)."),
    model: Optional[Path] = typer.Option(
        None,
        "--model",
        help="Model file, or the library spec the plan was made from (hf:CONFIG.json, timm:NAME, torchvision:NAME): enables the memory re-estimate and the drift check.",
    ),
    model_arg: Optional[List[str]] = ModelArg,
    pp: Optional[int] = typer.Option(None, "--pp", help="Pipeline stages of a lone DeepSpeed config (set in its training script)."),
    fmt: str = typer.Option("text", "--format", help="text | json | github (workflow annotations)"),
    strict: bool = typer.Option(False, "--strict", help="Fail on warnings too."),
    run_scripts: bool = typer.Option(
        False,
        "--run-scripts",
        help="Run launch scripts the planner did not render (or that were edited since) under bash with stub launchers, in a sandbox where the platform has one; without it they are read statically and nothing of them runs.",
    ),
    cache: bool = typer.Option(True, "--cache/--no-cache", help="Read and write the cache of analysed models (planner.model.cache)."),
    timeout: float = Timeout,
) -> None:
    """Check committed configs: engine rules, batch arithmetic, unknown keys, memory fit and drift from a fresh render."""
    from planner.check.validate import validate_paths

    with _errors():
        cv.choice("--format", fmt, cv.VALIDATE_FORMATS)
        _check_inputs(list(paths))
        cv.positive_int("--pp", pp)
        limit = _timeout(timeout)
        args = _model_args(model_arg) if model_arg else None
        with _user_code(model or Path("the model file"), limit, initial_phase="model"):
            code, text = validate_paths(paths, gpus=gpus, model=model, strict=strict, fmt=fmt, pp=pp, model_args=args, run_scripts=run_scripts, cache=cache)
    stdout().write(text)  # plain: messages contain [brackets] that rich would read as markup
    raise typer.Exit(code)


@app.command()
def explain(plan_dir: Path = typer.Argument(..., help="A plan directory (or its plan.json) written by `planner plan --out`.")) -> None:
    """Print the summary of an existing plan without re-planning."""
    from planner.report import explain as explain_plan

    with _errors():
        _check_inputs([plan_dir])
        try:
            explain_plan(out, plan_dir)
        except (KeyError, TypeError, ValueError, IndexError, StopIteration, AttributeError, ZeroDivisionError) as e:
            if isinstance(e, UnicodeDecodeError):
                raise
            raise UsageError(
                f"{str(plan_dir)!r} does not hold a readable plan.json: {type(e).__name__}: {e}.",
                "Re-plan with `planner plan ... --out DIR`; plan.json is written by the planner, not by hand.",
            ) from None


@app.command()
def version() -> None:
    """Print the planner version."""
    out.print(__version__)


#: the planner's own standard output once main() reserved it (None: sys.stdout, as under typer's CliRunner)
_STDOUT: Any = None


def stdout() -> Any:
    """Where the planner writes its results (--json documents, tables): its reserved stream, else sys.stdout."""
    return _STDOUT if _STDOUT is not None else sys.stdout


def _reserve_stdout() -> Any:
    """From process start, file descriptor 1 is the planner's alone: keep a private copy for its output, point
    descriptor 1 and sys.stdout at stderr, so whatever else writes to stdout (a model file's prints, its threads,
    atexit handlers, forked children, C code) lands on stderr and --json stays JSON. None when there is no stdout."""
    global _STDOUT
    try:
        fd = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        return None
    _STDOUT = os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=True)
    sys.stdout = _MainThreadStdout(_STDOUT)
    out.file = _STDOUT
    return _STDOUT


class _MainThreadStdout(io.TextIOBase):
    """sys.stdout once descriptor 1 is reserved: the main thread's writes (the planner's own: typer's help) go to the
    planner's stream, any other thread's (a model file's timers and workers) to stderr. While user code runs, the
    guard points sys.stdout at stderr outright (planner.model.guard)."""

    def __init__(self, mine: Any):
        super().__init__()
        self._mine = mine

    def _stream(self) -> Any:
        return self._mine if threading.current_thread() is threading.main_thread() else sys.stderr

    def write(self, text: str) -> int:
        return self._stream().write(text)

    def flush(self) -> None:
        self._stream().flush()

    def isatty(self) -> bool:
        return bool(self._stream().isatty())

    def fileno(self) -> int:
        return int(self._stream().fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(self._mine.encoding)


def _on_sigterm(signum: int, frame: Any) -> None:
    from planner.model.guard import Terminated

    raise Terminated(signum)


def main() -> None:
    """Entry point: unexpected exceptions (bugs) print one line and exit 3; PLANNER_DEBUG=1 shows the traceback.

    The exit status is 0, 1 (no answer) or 2 (bad input; a model file that ends or signals the process included), 3
    for a planner bug. The process ends with os._exit once its output is flushed, so a model file's lingering thread
    or atexit handler can neither hang it nor write after it."""
    _reserve_stdout()
    signal.signal(signal.SIGTERM, _on_sigterm)
    code = 0
    try:
        app()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        err.print("interrupted")
        code = 130
    except BaseException as e:  # noqa: BLE001
        if os.environ.get("PLANNER_DEBUG"):
            import traceback

            traceback.print_exc()
            code = 3
        else:
            import traceback

            tb = traceback.extract_tb(e.__traceback__)
            where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
            err.print(_styled("bold red", "internal error:", f" {type(e).__name__}: {e}{where}"))
            err.print("This is a planner bug. Re-run with PLANNER_DEBUG=1 for the traceback and report it with the command you ran.")
            code = 3
    finally:
        for stream in (_STDOUT, sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)
