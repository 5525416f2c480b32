"""The jinja2 templates every output is rendered from (templates/), and the escapes they use."""

from __future__ import annotations

import shlex
from typing import Any

import jinja2

from planner import __version__
from planner.resources import templates_dir


def shell_quote(value: Any) -> str:
    """Quote any value for POSIX shell: the result is one word, never expanded."""
    return shlex.quote(str(value))


def one_line(text: Any) -> str:
    """``text`` safe inside a ``#`` comment: line breaks spelled out, so nothing after them becomes code."""
    return str(text).replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


def environment() -> jinja2.Environment:
    """The jinja2 environment for all templates: strict undefined, ``shq`` filter for shell, ``tojson`` for JSON."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["shq"] = shell_quote
    env.filters["pyrepr"] = repr
    env.filters["one_line"] = one_line
    return env


def render_template(name: str, **context: Any) -> str:
    """Render ``templates/<name>`` (pass text bound for ``#`` comments through :func:`one_line`)."""
    return environment().get_template(name).render(version=__version__, **context)
