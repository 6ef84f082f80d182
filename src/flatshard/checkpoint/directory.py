"""Checkpoint directories: which one is complete, committing one crash-safely, and the ones beside it
(step directories, the ``latest`` pointer, ``keep_last`` rotation). Local file-system work only, no
collectives: save.py runs the writes on rank 0 and agrees on the outcome; load.py reads.

[Note: crash-safe commit]
A checkpoint is complete when its directory holds ``manifest.json`` (written last, after every rank
fsynced its file, and itself fsynced) and every file the manifest lists, at its recorded size. A save
to PATH never touches PATH until the new checkpoint is complete:

  1. rank 0 prepares (``prepare``): it finishes what an interrupted save left (below), refuses a PATH
     that is not a flatshard checkpoint (a directory holding anything else, a file), and creates an
     empty ``PATH.partial``; every rank writes and fsyncs its file there; rank 0 writes the manifest.
  2. rank 0 commits (``commit``): if PATH exists it is renamed to ``PATH.replaced`` (parent fsynced);
     then ``PATH.partial`` is renamed to PATH (parent fsynced): this second rename is the commit;
     then ``PATH.replaced`` is removed.

Killed at any point, PATH names a complete checkpoint: before step 2, the previous one (or none, for
a first save); between the two renames, there is no PATH, but ``PATH.replaced`` holds the previous
checkpoint complete, and ``committed(PATH)`` (what ``load``, ``latest``, ``consolidate`` and
``inspect`` read through) resolves PATH to it; after the commit, the new one. The next save to PATH
first restores that state: ``PATH.replaced`` without PATH is renamed back to PATH (the interrupted
commit is rolled back, its ``PATH.partial`` removed and rewritten), ``PATH.replaced`` beside a PATH
is the remains of a finished commit and is removed. Only rank 0 renames, so ranks never race; shared
storage is assumed (load checks that every rank read the same save, by the manifest's ``save_id``).

[Note: latest and rotation]
After the commit rank 0 writes the pointer ``dirname(PATH)/latest`` (JSON naming PATH's directory
name, its step and commit time; a temporary file fsynced, renamed over the old pointer, the parent
fsynced). A file named ``latest`` that is not flatshard's pointer is left alone. ``latest(dir)`` is
the newest complete checkpoint directly under ``dir``: the pointer's, when it names a complete
checkpoint and no manifest beside it is newer than the pointer itself; otherwise (killed between the
commit and the pointer, a removed or copied checkpoint, no pointer) the complete checkpoint with the
latest commit time (the manifest's ``committed_at``). ``keep_last=k`` then keeps k checkpoints: PATH
and the k - 1 most recently committed complete checkpoints among its siblings whose names are PATH's
with another number in place of its last one (``step-00000100``, ``step-00000200``; ``best`` or
``run2-step-00000100`` beside them are never counted); each other one is removed, first renamed to
``NAME.removing`` (so it stops being a checkpoint at once), then deleted. Directories that are not
complete flatshard checkpoints (no manifest, a missing or truncated file, another program's
manifest) are never removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Optional

from flatshard.api import CheckpointError
from flatshard.checkpoint.format import FORMAT, FORMAT_VERSION, MANIFEST, fsync_dir, write_json_atomic

PARTIAL, REPLACED, REMOVING = ".partial", ".replaced", ".removing"
POINTER, POINTER_FORMAT = "latest", "flatshard-latest"
_OWN_FILE = re.compile(
    r"(manifest\.json(\.tmp)?|rank-\d+-of-\d+\.safetensors|shard-\d+-model-\d+-of-\d+\.safetensors)"
)  # the second kind of shard file: a fully_shard checkpoint's ([Note: fully_shard checkpoints are DCP safetensors])


def step_path(directory, step: int) -> str:
    """``directory/step-00000100`` for step 100: the name ``latest`` and ``keep_last`` expect."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step_path needs a step that is an int >= 0, got {step!r}")
    return os.path.join(os.fspath(directory), f"step-{step:08d}")


def committed(path: str) -> Optional[str]:
    """The directory that holds the checkpoint committed at ``path``: ``path`` itself, or
    ``path.replaced`` while a commit that replaces it is stopped between its renames; None if neither."""
    if os.path.isdir(path):
        return path
    if os.path.isfile(os.path.join(path + REPLACED, MANIFEST)):
        return path + REPLACED
    return None


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path`` (through ``committed``), with its files present and of
    the recorded sizes; raises ``CheckpointError`` naming what is wrong."""
    return manifest_in(locate(path), path)


def locate(path: str) -> str:
    """``committed(path)``, or a ``CheckpointError`` saying what is there instead."""
    where = committed(path)
    if where is not None:
        return where
    hint = ""
    if os.path.isdir(path + PARTIAL):
        hint = f"; {path}{PARTIAL} holds a save that never finished (it is not loadable; the next save removes it)"
    raise CheckpointError(f"no checkpoint at {path}{hint}")


def manifest_in(where: str, path: Optional[str] = None) -> dict:
    path = path or where
    mpath = os.path.join(where, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(
            f"{path} has no {MANIFEST}: the checkpoint is incomplete or not a flatshard checkpoint; "
            "load an earlier checkpoint"
        )
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{mpath} is not valid JSON ({exc}): the manifest is corrupt; load an earlier checkpoint"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not a flatshard checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has format version {manifest['format_version']}; this flatshard reads up to "
            f"{FORMAT_VERSION}: upgrade flatshard"
        )
    for name, rec in manifest["files"].items():
        file = os.path.join(where, name)
        if not os.path.exists(file):
            raise CheckpointError(
                f"shard file {file} is missing: the checkpoint is incomplete; restore the file or load "
                "an earlier checkpoint"
            )
        if os.path.getsize(file) != rec["bytes"]:
            raise CheckpointError(
                f"shard file {file} is truncated or altered: {os.path.getsize(file)} bytes on disk, the "
                f"manifest records {rec['bytes']}; restore the file or load an earlier checkpoint"
            )
    return manifest


# ---- saving: prepare, commit ---------------------------------------------------------------------
def prepare(path: str) -> None:
    """Rank 0, before any rank writes: finish what an interrupted save to ``path`` left, refuse a
    ``path`` that flatshard does not own, and create an empty ``path.partial`` ([Note: crash-safe commit])."""
    parent = os.path.dirname(path)
    old, partial = path + REPLACED, path + PARTIAL
    if os.path.lexists(old):
        if not os.path.lexists(path):
            os.rename(old, path)  # a commit stopped between its renames: roll it back
        else:
            shutil.rmtree(old)  # a commit stopped while removing what it replaced
        fsync_dir(parent)
    if os.path.lexists(path):
        foreign = _foreign(path)
        if foreign:
            raise CheckpointError(
                f"{path} exists and is not a flatshard checkpoint ({foreign}); a save there would replace "
                "it: choose another path, or remove it first"
            )
    if os.path.lexists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)


def _foreign(path: str) -> Optional[str]:
    """What makes ``path`` something a save must not replace (None: a flatshard checkpoint, or empty)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return "it is not a directory"
    others = sorted(n for n in os.listdir(path) if not _OWN_FILE.fullmatch(n))
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        return "it holds " + ", ".join(others[:3]) + more
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            ours = json.load(f).get("format") == FORMAT
    except FileNotFoundError:
        return None  # empty, or a save's files without their manifest
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        ours = False
    return None if ours else f"its {MANIFEST} is not a flatshard manifest"


def commit(partial: str, path: str, reached: Optional[Callable[[str], None]] = None) -> None:
    """Rename the complete ``partial`` to ``path``, never leaving ``path`` without a complete checkpoint
    ([Note: crash-safe commit]). ``reached`` is told ``"between_renames"`` and ``"after_commit"``."""
    parent = os.path.dirname(path)
    old = path + REPLACED
    if os.path.lexists(path):
        if os.path.lexists(old):
            shutil.rmtree(old)
        os.rename(path, old)
        fsync_dir(parent)
        if reached is not None:
            reached("between_renames")
    os.rename(partial, path)  # the commit
    fsync_dir(parent)
    if reached is not None:
        reached("after_commit")
    if os.path.lexists(old):
        shutil.rmtree(old)


# ---- the pointer, latest, rotation -------------------------------------------------------------
def write_pointer(path: str, step, committed_at: float) -> Optional[str]:
    """Point ``dirname(path)/latest`` at ``path`` ([Note: latest and rotation]); returns why it did not
    (the pointer is a shortcut for ``latest``, never needed for a load), or None."""
    parent, name = os.path.split(path)
    pointer = os.path.join(parent, POINTER)
    if os.path.lexists(pointer) and _read_pointer(pointer) is None:
        return f"{pointer} exists and is not flatshard's pointer: left as it is (checkpoint.latest still works)"
    try:
        write_json_atomic(
            pointer, {"format": POINTER_FORMAT, "checkpoint": name, "step": step, "committed_at": committed_at}
        )
        fsync_dir(parent)
    except OSError as exc:
        return f"writing {pointer} failed: {exc} (checkpoint.latest still works)"
    return None


def _read_pointer(pointer: str) -> Optional[str]:
    """The directory name the pointer file names, or None if it is not a flatshard pointer."""
    try:
        with open(pointer) as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    name = data.get("checkpoint") if isinstance(data, dict) and data.get("format") == POINTER_FORMAT else None
    if not isinstance(name, str) or name in ("", ".", "..") or os.sep in name or "/" in name:
        return None
    return name


def _candidates(directory: str) -> dict[str, str]:
    """{checkpoint path: directory holding it} for every entry of ``directory`` with a manifest (not yet
    checked further), an interrupted commit's ``NAME.replaced`` under NAME."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {}
    for name in names:
        if name.endswith((PARTIAL, REMOVING)) or name == POINTER:
            continue
        path = os.path.join(directory, name)
        if name.endswith(REPLACED):
            base = path[: -len(REPLACED)]
            if not os.path.lexists(base) and os.path.isfile(os.path.join(path, MANIFEST)):
                found[base] = path
        elif os.path.isfile(os.path.join(path, MANIFEST)):
            found[path] = path
    return found


def _newest_first(found: dict[str, str]) -> list[str]:
    """The complete checkpoints among ``found``, the most recently committed first."""
    ranked = []
    for path, where in found.items():
        try:
            manifest = manifest_in(where, path)
        except (CheckpointError, OSError, KeyError, TypeError):
            continue  # not complete (or not ours): never a candidate
        at = manifest.get("committed_at")
        if not isinstance(at, (int, float)):
            at = os.stat(os.path.join(where, MANIFEST)).st_mtime
        ranked.append((float(at), path))
    return [p for _, p in sorted(ranked, reverse=True)]


def latest(directory) -> Optional[str]:
    """The newest complete checkpoint directly under ``directory`` (its path, ``directory`` joined with
    its name as ``step_path`` does), or None if there is none ([Note: latest and rotation]). Local: it
    reads the file system and runs no collective."""
    given = os.fspath(directory)
    directory = os.path.abspath(given)
    found = _candidates(directory)
    pointer = os.path.join(directory, POINTER)
    name = _read_pointer(pointer) if os.path.isfile(pointer) else None
    target = os.path.join(directory, name) if name is not None else None
    if name is not None and target in found:
        since = os.stat(pointer).st_mtime_ns
        newer = [p for p, w in found.items() if p != target and _mtime_ns(w) >= since]
        if not newer and _newest_first({target: found[target]}):
            return os.path.join(given, name)
    ranked = _newest_first(found)
    return os.path.join(given, os.path.basename(ranked[0])) if ranked else None


def _mtime_ns(where: str) -> int:
    try:
        return os.stat(os.path.join(where, MANIFEST)).st_mtime_ns
    except OSError:
        return 0


def _named_like(name: str) -> re.Pattern:
    """Names that are ``name`` with another number in place of its last one (``step-00000100``:
    ``step-00000200``, ``step-123456789``); a name without digits matches only itself."""
    digits = list(re.finditer(r"\d+", name))
    if not digits:
        return re.compile(re.escape(name))
    last = digits[-1]
    return re.compile(re.escape(name[: last.start()]) + r"\d+" + re.escape(name[last.end() :]))


def rotate(path: str, keep_last: int, reached: Optional[Callable[[str], None]] = None) -> list[str]:
    """Keep ``path`` and the ``keep_last - 1`` most recently committed other complete checkpoints named
    like it beside it; remove the rest of those ([Note: latest and rotation]). Returns the paths removed.
    ``reached`` is told ``"removing"`` once a checkpoint is renamed to ``NAME.removing``."""
    parent, name = os.path.split(path)
    like = _named_like(name)
    for leftover in os.listdir(parent):  # a rotation killed while deleting
        if leftover.endswith(REMOVING) and like.fullmatch(leftover[: -len(REMOVING)]):
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
    found = {p: w for p, w in _candidates(parent).items() if like.fullmatch(os.path.basename(p))}
    others = [p for p in _newest_first(found) if p != path]
    keep = set(others[: keep_last - 1])  # and path, always: k in all
    removed = []
    for p in others:
        if p in keep:
            continue
        doomed = p + REMOVING
        if os.path.lexists(doomed):
            shutil.rmtree(doomed)
        os.rename(found[p], doomed)
        fsync_dir(parent)
        if reached is not None:
            reached("removing")
        shutil.rmtree(doomed)
        removed.append(p)
    return removed
