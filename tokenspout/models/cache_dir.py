"""Where tokenspout keeps what it derives from models ($TOKENSPOUT_CACHE, default ~/.cache/tokenspout), and the one way
folders are written there (whole or not at all)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENSPOUT_CACHE", Path.home() / ".cache" / "tokenspout"))


@contextlib.contextmanager
def folder_written_whole(target: Path) -> Iterator[Path]:
    """A temporary folder beside `target` to write into; renamed to `target` when the block ends without an error,
    deleted otherwise, so a reader never sees half a folder (callers hold a file lock against a second writer)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
