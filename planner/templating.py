"""The jinja2 templates every output is rendered from (templates/), and the escapes they use."""

from __future__ import annotations

import shlex
from typing import Any

import jinja2

from planner import __version__
from planner.escape import code_span, html_comment, markdown_text, one_line
from planner.resources import templates_dir

__all__ = ["environment", "one_line", "render_template", "shell_quote"]


def shell_quote(value: Any) -> str:
    """Quote any value for POSIX shell: the result is one word, never expanded."""
    return shlex.quote(str(value))


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
    env.filters["html_comment"] = html_comment
    env.filters["md"] = markdown_text
    env.filters["code"] = code_span
    return env


def render_template(name: str, **context: Any) -> str:
    """Render ``templates/<name>`` (pass text bound for ``#`` comments through :func:`one_line`)."""
    return environment().get_template(name).render(version=__version__, **context)
