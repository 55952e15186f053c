"""Walking an ImageFolder tree: image files in sorted order, symbolic links kept inside it.

The walk of :func:`echopipe.data.scan_image_folder`; see its notes on links.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["link_problem", "walk_images"]


def _inside(path: str, real_root: str) -> bool:
    return path == real_root or path.startswith(real_root.rstrip(os.sep) + os.sep)


def link_problem(path: str, real_root: str, walking: set[str]) -> str | None:
    """Why the symbolic link ``path`` is left out, or ``None`` if it may be followed."""
    try:
        target = os.path.realpath(path, strict=True)
    except (OSError, RuntimeError):
        return "link loops or dangles"
    if not _inside(target, real_root):
        return f"link leaves the data folder (to {target})"
    if target in walking:
        return "link loops back into a folder above it"
    return None


def walk_images(
    folder: Path, exts: tuple[str, ...], real_root: str, links_skipped: list[tuple[str, str]]
) -> Iterator[str]:
    # Depth first with the real paths of the folders being walked, so a link back into one of
    # them is seen as a loop; links out of the root are refused before they are followed. The
    # root counts as walked: a link to it would file every class's images under this one.
    stack = [(str(folder), frozenset({real_root, os.path.realpath(folder)}))]
    while stack:
        dirpath, walking = stack.pop()
        try:
            entries = sorted(os.scandir(dirpath), key=lambda e: e.name)
        except OSError as exc:  # its images would be left out unnoticed: refuse instead
            raise OSError(exc.errno, f"cannot list the data folder {dirpath!r}: "
                          f"{exc.strerror or exc}") from None  # fmt: skip
        subdirs = []
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_symlink():
                reason = link_problem(e.path, real_root, set(walking))
                if reason is not None:
                    links_skipped.append((e.path, reason))
                    continue
            if e.is_dir(follow_symlinks=True):
                subdirs.append(e.path)
            elif e.name.lower().endswith(exts) and e.is_file(follow_symlinks=True):
                yield e.path
        for sub in reversed(subdirs):
            stack.append((sub, walking | {os.path.realpath(sub)}))
