"""A plan directory's own bookkeeping (the manifest, an update's journal and staging folders) is untrusted input: a
plan directory comes from a repository. Whatever it names, no file outside the directory is created, changed or
deleted by a plan, a re-plan or a recovery, and a user's directory where a planned file goes is kept.

Reference: a snapshot of everything outside the plan directory (every entry, by lstat: symlinks as links, files by
their bytes) taken before and compared after; hypothesis generates the hostile trees.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import fileio
from planner.errors import UsageError


def _tree(root: Path, skip: Path | None = None) -> dict[str, object]:
    """Every entry under ``root`` but ``skip``: a symlink's target, a file's bytes, a directory's mark."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        if skip is not None and (d == skip or skip in d.parents):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = d / name
            if skip is not None and p == skip:
                continue
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "dir"
    return out


@pytest.fixture
def world(tmp_path, tiny_plan):
    """(plan, the plan directory written once, the outside directory holding a victim file)."""
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("outside data")
    out = tmp_path / "repo" / "plan"
    out.parent.mkdir()
    write_plan_dir(out, plan)
    return plan, out, outside


def _manifest(out: Path) -> dict:
    return json.loads((out / ".planner").read_text())


def test_a_manifest_entry_through_a_symlinked_directory_deletes_nothing_outside(world, tmp_path):
    from planner.render import write_plan_dir

    plan, out, outside = world
    (out / "linkdir").symlink_to(outside, target_is_directory=True)
    man = _manifest(out)
    man["files"].append("linkdir/victim.txt")
    man["sha256"]["linkdir/victim.txt"] = hashlib.sha256(b"outside data").hexdigest()  # even with the right hash
    man["files"].append("../outside/victim.txt")
    (out / ".planner").write_text(json.dumps(man))
    before = _tree(tmp_path, skip=out)
    notes = write_plan_dir(out, plan)
    assert _tree(tmp_path, skip=out) == before
    assert any("linkdir/victim.txt" in n and "symlink" in n for n in notes)


def test_a_user_directory_where_a_planned_file_was_is_kept_force_or_not(world):
    from planner.render import write_plan_dir

    plan, out, _ = world
    (out / "ds_config.json").unlink()
    (out / "ds_config.json").mkdir()
    (out / "ds_config.json" / "mine.json").write_text("{}")
    for force in (False, True):
        with pytest.raises(UsageError, match="never deletes a directory"):
            write_plan_dir(out, plan, force=force)
        assert (out / "ds_config.json" / "mine.json").read_text() == "{}"


def _crash_mid_update(out: Path, plan) -> None:
    """Interrupt an update after its journal, leaving .planner.old.ID and .planner.tmp.ID."""
    from planner.render import write_plan_dir

    class Crash(BaseException):
        pass

    def hook(name):
        if name.startswith("aside"):
            raise Crash()

    fileio.STEP_HOOK = hook
    try:
        with pytest.raises(Crash):
            write_plan_dir(out, plan, force=True)
    finally:
        fileio.STEP_HOOK = None


def _journal(out: Path) -> Path:
    return next(out.glob(".planner.old.*")) / fileio.JOURNAL


def test_a_journal_naming_paths_outside_neither_deletes_nor_writes_there(world, tmp_path):
    plan, out, outside = world
    _crash_mid_update(out, plan)
    journal = _journal(out)
    doc = json.loads(journal.read_text())
    doc["names"] += ["../../outside/victim.txt", "../../written_outside.txt"]
    journal.write_text(json.dumps(doc))
    files = journal.parent / "files"
    (files / "x").mkdir(parents=True, exist_ok=True)
    before = _tree(tmp_path, skip=out)
    notes = fileio.recover_dir(out, ".planner")
    assert _tree(tmp_path, skip=out) == before
    assert notes and "not one the planner wrote" in notes[0]
    assert not (tmp_path / "written_outside.txt").exists() and (outside / "victim.txt").read_text() == "outside data"


def test_a_placed_file_is_removed_by_a_rollback_only_when_it_is_what_the_planner_wrote(world):
    from planner.render import write_plan_dir

    plan, out, _ = world
    (out / "report.md").unlink()  # so the interrupted update adds it anew
    (out / "mine.txt").write_text("user data")
    fileio.STEP_HOOK = None

    class Crash(BaseException):
        pass

    def hook(name):
        if name == "placed report.md":
            raise Crash()

    man = _manifest(out)
    fileio.STEP_HOOK = hook
    try:
        with pytest.raises(Crash):
            write_plan_dir(out, plan)
    finally:
        fileio.STEP_HOOK = None
    (out / "report.md").write_text("edited by hand after the crash")
    notes = fileio.recover_dir(out, ".planner")
    assert (out / "report.md").read_text() == "edited by hand after the crash"
    assert any("report.md" in n and "left" in n for n in notes)
    assert man == _manifest(out)


def test_a_staging_folder_symlinked_outside_loses_nothing_behind_it(world, tmp_path):
    plan, out, outside = world
    (outside / "files").mkdir()
    (outside / "files" / "plan.json").write_text("theirs")
    (outside / fileio.JOURNAL).write_text(json.dumps({"names": ["plan.json"], "existed": ["plan.json"], "new": {}}))
    (out / ".planner.old.deadbeef").symlink_to(outside, target_is_directory=True)
    (out / ".planner.tmp.deadbeef").symlink_to(outside, target_is_directory=True)
    before = _tree(tmp_path, skip=out)
    notes = fileio.recover_dir(out, ".planner")
    assert _tree(tmp_path, skip=out) == before
    assert len([n for n in notes if "untouched" in n]) == 2


# --------------------------------------------------------------------------- hypothesis: hostile trees

_NAMES = st.sampled_from(["plan.json", "README.md", "ds_config.json", "linkdir/victim.txt", "../outside/victim.txt", "sub/x", "/abs", "linkdir", "a/../b"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    manifest=st.lists(_NAMES, max_size=5),
    journal=st.lists(_NAMES, max_size=5),
    link_old=st.booleans(),
    link_in_files=st.booleans(),
    crash=st.booleans(),
)
def test_no_bookkeeping_changes_a_path_outside(tmp_path_factory, tiny_plan, manifest, journal, link_old, link_in_files, crash):
    from planner.render import write_plan_dir

    plan, _ = tiny_plan
    root = tmp_path_factory.mktemp("world")
    outside = root / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("outside data")
    out = root / "repo" / "plan"
    out.parent.mkdir()
    write_plan_dir(out, plan)
    (out / "linkdir").symlink_to(outside, target_is_directory=True)
    man = _manifest(out)
    for name in manifest:
        man["files"].append(name)
        man["sha256"][name] = hashlib.sha256(b"outside data").hexdigest()
    (out / ".planner").write_text(json.dumps(man))
    if crash:
        _crash_mid_update(out, plan)
        j = _journal(out)
        doc = json.loads(j.read_text())
        doc["names"] += journal
        doc["existed"] += journal
        j.write_text(json.dumps(doc))
        if link_in_files:
            (j.parent / "files" / "README.md").unlink(missing_ok=True)
            (j.parent / "files" / "README.md").symlink_to(outside / "victim.txt")
    if link_old:
        (out / ".planner.old.0badc0de").symlink_to(outside, target_is_directory=True)
    before = _tree(root, skip=out)
    try:
        write_plan_dir(out, plan, force=True)
    except UsageError:
        pass
    assert _tree(root, skip=out) == before
