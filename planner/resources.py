"""Where the bundled data lives: hardware profiles and jinja2 templates.

In a source checkout they are the top-level ``hardware_profiles/`` and
``templates/`` folders; an installed wheel carries them as the packages
``planner.hardware_profiles`` and ``planner.templates`` (see pyproject.toml).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _locate(package: str, folder: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if Path(loc).is_dir():
                return Path(loc)
    return _REPO / folder


def hardware_profiles_dir() -> Path:
    """Folder of the bundled ``*.yaml`` device profiles."""
    return _locate("planner.hardware_profiles", "hardware_profiles")


def templates_dir() -> Path:
    """Folder of the bundled jinja2 templates."""
    return _locate("planner.templates", "templates")
