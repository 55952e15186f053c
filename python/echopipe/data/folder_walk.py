"""Walking an ImageFolder tree: its class folders and image files in sorted order, symbolic
links kept inside it, names DALI can open, and image files opened only when regular.

The walk of :func:`echopipe.data.scan_image_folder`; see its notes on links.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "OTHER_IMAGE_EXTENSIONS",
    "RENAME",
    "ClassHomes",
    "class_folders",
    "is_utf8",
    "link_problem",
    "links_left_out",
    "list_tree",
    "open_regular_image",
    "walk_images",
]

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISDIR, "a folder"))  # fmt: skip


OTHER_IMAGE_EXTENSIONS = (".bmp", ".gif", ".pbm", ".pgm", ".pnm", ".ppm", ".tif", ".tiff", ".webp")
"""Endings of image formats that torchvision's ImageFolder (Pillow) reads and echopipe does not:
such a file in a data folder is left out and counted, never passed over in silence (a folder
that torchvision trains on whole would train here on fewer images, with no word of it)."""


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return f"is {kind}, not a regular file (not opened: reading it could wait forever)"


def open_regular_image(path: str) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file. Anything else (a FIFO whose
    writer never writes, a device, a socket) raises ValueError saying what it is, without
    being opened: a blocking open or read of one could wait forever. The type is checked again
    on the open descriptor (opened without blocking), so a name swapped in between is refused
    too. OSError when it cannot be read."""
    problem = _not_regular(os.stat(path).st_mode)
    if problem is not None:
        raise ValueError(problem)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        problem = _not_regular(os.fstat(fd).st_mode)
        if problem is not None:
            raise ValueError(problem)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


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


class ClassHomes:
    """The real folders of a split's classes, to tell a link into another class's folder (or
    into a folder above one) in a few dictionary look-ups, not one per class."""

    def __init__(self, root_path: Path, real_root: str, classes: list[str]) -> None:
        self.real_root = real_root
        self.homes = {os.path.realpath(root_path / name): name for name in classes}
        self.above: dict[str, str] = {}  # folders inside the root that hold a class folder
        for home, name in self.homes.items():
            up = os.path.dirname(home)
            while up != real_root and _inside(up, real_root) and up not in self.above:
                self.above[up] = name
                up = os.path.dirname(up)

    def other_class(self, path: str, own: str) -> str | None:
        """Why the link ``path`` in class ``own`` is left out, or None."""
        target = os.path.realpath(path)
        name = self.above.get(target)
        up = target
        while name is None and up != self.real_root and _inside(up, self.real_root):
            name = self.homes.get(up)
            up = os.path.dirname(up)
        if name is None or name == own:
            return None
        return f"link into the class folder {name!r} (its images would get two labels)"


def walk_images(
    folder: Path,
    exts: tuple[str, ...],
    real_root: str,
    links_skipped: list[tuple[str, str]],
    not_files: dict[str, str] | None = None,
    others: list[tuple[str, str]] | None = None,
    homes: ClassHomes | None = None,
) -> Iterator[str]:
    """The image files under ``folder``. An entry named like an image that is neither a folder
    nor a regular file (a FIFO, socket or device) is yielded too, with why it is refused put in
    ``not_files``, so the scan names it; it is never opened. Files of the image formats of
    :data:`OTHER_IMAGE_EXTENSIONS` not among ``exts`` are added to ``others`` with why they are
    left out. With ``homes``, a link into another class folder is left out too: its images
    would be trained under this class's label as well as their own."""
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
                if reason is None and homes is not None:
                    reason = homes.other_class(e.path, folder.name)
                if reason is not None:
                    links_skipped.append((e.path, reason))
                    continue
            if e.is_dir(follow_symlinks=True):
                subdirs.append(e.path)
            elif e.name.lower().endswith(exts):
                if e.is_file(follow_symlinks=True):
                    yield e.path
                elif not_files is not None:
                    try:  # a stat, not an open: a FIFO's open would wait for a writer
                        problem = _not_regular(e.stat().st_mode)
                    except OSError as exc:
                        problem = f"cannot read: {exc.strerror or exc}"
                    if problem is not None:
                        not_files[e.path] = problem
                    yield e.path
            elif others is not None and e.name.lower().endswith(OTHER_IMAGE_EXTENSIONS):
                suffix = os.path.splitext(e.name)[1]
                others.append((e.path, f"a {suffix} file: echopipe reads JPEG and PNG only "
                               "(convert it to either)"))  # fmt: skip
        for sub in reversed(subdirs):
            stack.append((sub, walking | {os.path.realpath(sub)}))


RENAME = "; DALI's file reader takes only UTF-8 names: rename it"


def is_utf8(name: str) -> bool:
    """Whether ``name`` is valid UTF-8 on disk: ``os.scandir`` gives the bytes of other names as
    lone surrogates, which DALI's reader refuses with a bare type error."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def links_left_out(links_skipped: list[tuple[str, str]]) -> str:
    """What a line about too few class folders adds when some were symbolic links left out
    (class folders linked one by one from another disk are all left out; without this the
    line said the folder had none)."""
    if not links_skipped:
        return ""
    path, why = links_skipped[0]
    return (
        f"; {len(links_skipped)} symbolic link(s) in it are left out (e.g. {path}: {why}): "
        "a link to the split folder itself is followed, links out of it are not"
    )


def class_folders(
    root_path: Path, real_root: str, links_skipped: list[tuple[str, str]]
) -> list[str]:
    """The sorted class folder names of ``root_path`` (links that leave it are skipped); an
    OSError naming it when it cannot be listed."""
    try:
        entries = sorted(os.scandir(root_path), key=lambda e: e.name)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot list the data folder {str(root_path)!r}: "
                      f"{exc.strerror or exc}") from None  # fmt: skip
    classes = []
    for e in entries:
        if e.name.startswith(".") or not e.is_dir(follow_symlinks=True):
            continue
        if not is_utf8(e.name):  # its label would be a name no one can print or type
            raise ValueError(f"class folder {e.path!r} has a name that is not UTF-8{RENAME}")
        reason = link_problem(e.path, real_root, set()) if e.is_symlink() else None
        if reason is None:
            classes.append(e.name)
        else:
            links_skipped.append((e.path, reason))
    return classes


def _not_aliases(
    root_path: Path, real_root: str, classes: list[str], links_skipped: list[tuple[str, str]]
) -> list[str]:
    """``classes`` less the class folders that are links to another one (or into or above
    one), which are left out: their images would be trained under two labels."""
    linked = {name for name in classes if (root_path / name).is_symlink()}
    if not linked:
        return classes
    homes = ClassHomes(root_path, real_root, [n for n in classes if n not in linked])
    kept = []
    for name in classes:
        reason = homes.other_class(str(root_path / name), name) if name in linked else None
        if reason is None:
            kept.append(name)
        else:
            links_skipped.append((str(root_path / name), reason))
    return kept


def list_tree(
    root_path: Path,
    exts: tuple[str, ...],
    links_skipped: list[tuple[str, str]],
    not_files: dict[str, str],
    on_classes: Callable[[list[str]], None] | None = None,
    others: list[tuple[str, str]] | None = None,
) -> tuple[list[str], list[str], list[int]]:
    """``(classes, files, labels)`` of the tree ``root_path``: its class folders (given to
    ``on_classes`` before any image is listed) and all its image files with their labels,
    listed whole before any is checked, so a folder that cannot be listed stops the scan before
    an hour of decoding and the count gives the progress lines their total. FileNotFoundError
    for a missing ``root_path``, ValueError for one without classes or not named in UTF-8,
    OSError naming a folder that cannot be listed. Files of other image formats go to
    ``others`` (see :func:`walk_images`)."""
    if not root_path.is_dir():
        what = "is not a folder" if root_path.exists() else "does not exist"
        raise FileNotFoundError(f"image folder {str(root_path)!r} {what}")
    if not is_utf8(str(root_path)):
        raise ValueError(f"image folder {str(root_path)!r} has a name that is not UTF-8{RENAME}")
    real_root = os.path.realpath(root_path)
    classes = _not_aliases(root_path, real_root, class_folders(root_path, real_root, links_skipped),
                           links_skipped)  # fmt: skip
    if not classes:
        raise ValueError(
            f"image folder {str(root_path)!r} has no class sub-folders"
            f"{links_left_out(links_skipped)}"
        )
    if on_classes is not None:
        on_classes(classes)
    files: list[str] = []
    labels: list[int] = []
    homes = ClassHomes(root_path, real_root, classes)
    for label, name in enumerate(classes):
        for path in walk_images(
            root_path / name, exts, real_root, links_skipped, not_files, others, homes
        ):
            files.append(path)
            labels.append(label)
    return classes, files, labels
