"""The record every `planner validate` check returns, the rule table, and the three output formats.

A :class:`Finding` has the shape of :class:`planner.engines.megatron.architecture.Finding`
(rule id, severity, line, message, fix hint) plus the file it is about and an
optional multi-line ``detail`` (a unified diff for drift). Megatron findings are
wrapped with :func:`from_megatron`. The rule tables register through each engine's spec: ``MEG*`` and ``DS*`` are the
RULES of the wings' validate parts, ``PLAN*``/``MEM*``/``DRIFT*``/``SCRIPT*`` planner.check.validate's own
(planner.check.validate.all_rules joins them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Finding:
    """One problem: which rule, how bad, where (file, 1-based line or None), what, and how to fix it."""

    rule: str
    severity: Severity
    file: str
    line: int | None
    message: str
    fix: str
    detail: str = ""  # e.g. a unified diff; printed after the finding in text form

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.severity} {self.rule}: {self.message} Fix: {self.fix}"


def from_megatron(f, file: str) -> Finding:
    """Wrap a planner.engines.megatron.architecture.Finding with its file."""
    return Finding(f.rule, f.severity, file, f.line, f.message, f.fix)


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (f.file, f.line or 0, SEVERITY_ORDER[f.severity], f.rule, f.message))


def exit_code(findings: Iterable[Finding], strict: bool = False) -> int:
    """0 clean, 1 when a finding is an error (or a warning, with ``strict``)."""
    bad = {"error", "warning"} if strict else {"error"}
    return 1 if any(f.severity in bad for f in findings) else 0


# --------------------------------------------------------------------------- formats


def format_text(findings: list[Finding], checked: list[str] | None = None) -> str:
    """One line per finding (``file:line: severity RULE: message Fix: hint``), details indented below, and a summary."""
    out: list[str] = []
    for f in findings:
        out.append(str(f))
        if f.detail:
            out.extend("    " + line for line in f.detail.rstrip("\n").split("\n"))
    summary = _summary(findings)
    if checked is not None:
        summary += f" in {len(checked)} file(s) checked"
    out.append(summary)
    return "\n".join(out) + "\n"


def format_json(findings: list[Finding]) -> str:
    """A JSON list of findings (``rule, severity, file, line, message, fix, detail``)."""
    return json.dumps([f.to_dict() for f in findings], indent=2, sort_keys=True) + "\n"


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


GITHUB_COMMAND = {"error": "error", "warning": "warning", "info": "notice"}


def github_line(f: Finding) -> str:
    """A GitHub Actions workflow command: ``::error file=F,line=L,title=RULE::message Fix: hint``."""
    props = [f"file={_escape_property(f.file)}"]
    if f.line:
        props.append(f"line={f.line}")
    props.append(f"title={_escape_property(f.rule)}")
    body = f"{f.message} Fix: {f.fix}"
    if f.detail:
        body += "\n" + f.detail.rstrip("\n")
    return f"::{GITHUB_COMMAND[f.severity]} {','.join(props)}::{_escape_data(body)}"


def format_github(findings: list[Finding]) -> str:
    """One workflow annotation per finding (errors, warnings, and infos as notices), then the text summary."""
    return "\n".join([github_line(f) for f in findings] + [_summary(findings)]) + "\n"


def _summary(findings: list[Finding]) -> str:
    counts = {s: sum(1 for f in findings if f.severity == s) for s in ("error", "warning", "info")}
    return f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)"


def format_findings(findings: list[Finding], fmt: str, checked: list[str] | None = None) -> str:
    if fmt == "text":
        return format_text(findings, checked)
    if fmt == "json":
        return format_json(findings)
    if fmt == "github":
        return format_github(findings)
    from planner.errors import UsageError

    raise UsageError(f"--format {fmt!r} is not one of text, json, github.")
