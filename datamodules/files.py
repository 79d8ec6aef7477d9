"""Input file patterns, one rule for every datamodule and data script (text documents, text and image
WebDataset shards, ``scripts/pretokenize.py``).

A pattern is a path, a directory, a glob or a brace pattern, or several of them (a list, or one
string joined by ``::`` as webdataset writes shard lists):

* braces are expanded first (``braceexpand``, as webdataset does): ``text-{000..002}.tar``,
  ``{train,extra}/*.tar``;
* then each result is a file, a directory (the files under it, recursively, whose names end with
  one of ``suffixes``) or a glob (``*``, ``?``, ``[...]``, ``**`` across folders);
* URLs (``pipe:``, ``http(s)://``, ``gs://``, ``s3://``, ``ais://``) pass unchecked where the reader
  streams them (``remote=True``: WebDataset shards); ``file://`` is a local path.

Matches come in the order of the entries, each entry's matches sorted.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Sequence

__all__ = ["expand_pattern", "is_pattern", "REMOTE"]

REMOTE = re.compile(r"^(pipe:|https?://|gs://|s3://|ais://)")
"""URL schemes webdataset streams itself."""


def is_pattern(path: str | os.PathLike) -> bool:
    """Whether ``path`` names several files by this module's rule rather than one: a directory, a glob (``*``,
    ``?``, ``[...]``), braces (``{a,b}``, ``{1..3}``) or entries joined by ``::``, and not an existing file."""
    text = str(path)
    p = Path(text).expanduser()
    return p.is_dir() or (not p.is_file() and (glob.has_magic(text) or ("{" in text and "}" in text)
                                                or "::" in text))


def expand_pattern(pattern: str | os.PathLike | Sequence[str | os.PathLike], what: str = "path",
                   suffixes: Sequence[str] | None = None, remote: bool = False, kind: str = "files") -> list[str]:
    """The files (and, with ``remote``, URLs) named by ``pattern`` (see the module docstring).

    Args:
        pattern: one pattern, several joined by ``::``, or a list of them.
        what: the option it came from, named in errors (``"data.init_args.path"``, ``"train_path"``).
        suffixes: file name endings taken from a directory (``None``: every file).
        remote: keep URLs as they are (else they are looked up as local paths and fail).
        kind: what the files are, in messages (``"files"``, ``"shards"``).

    Raises:
        FileNotFoundError: a path, glob or directory that matches no file, or brace expansions that do
            not exist (the message names ``what``, the pattern, how many are missing and the first three).
        ValueError: an empty pattern.
    """
    import braceexpand

    entries = [pattern] if isinstance(pattern, (str, os.PathLike)) else list(pattern)
    entries = [p.strip() for e in entries for p in str(e).split("::") if p.strip()]
    if not entries:
        raise ValueError(f"{what}: pattern {pattern!r} names no {kind}")
    out: list[str] = []
    for entry in entries:
        expanded = list(braceexpand.braceexpand(entry))
        missing = []
        for item in expanded:
            if remote and REMOTE.match(item):
                out.append(item)
                continue
            path = Path(item[7:] if item.startswith("file://") else item).expanduser()
            if path.is_dir():
                found = sorted(str(f) for f in path.rglob("*")
                               if f.is_file() and (suffixes is None or f.name.lower().endswith(tuple(suffixes))))
                if not found:
                    ends = f" ending in {', '.join(suffixes)}" if suffixes else ""
                    raise FileNotFoundError(f"{what}: directory {str(path)!r} holds no file{ends}")
            elif path.is_file():
                found = [str(path)]
            else:
                found = sorted(f for f in glob.glob(str(path), recursive=True) if os.path.isfile(f)) \
                    if glob.has_magic(str(path)) else []
            if not found:
                missing.append(item)
            out += found
        if missing and len(expanded) > 1:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise FileNotFoundError(f"{what}: {len(missing)} of {len(expanded)} {kind} from pattern {entry!r} do "
                                    f"not exist, e.g. {missing[:3]}{more}")
        if missing:
            raise FileNotFoundError(f"{what}: {entry!r} matches no {kind[:-1] if kind.endswith('s') else kind}")
    return out
