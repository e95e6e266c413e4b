"""The embedded default corpus: the Python sources of the running interpreter's standard library.

Real text every machine has, no download. Documents are whole `.py` files, listed in sorted
order of their path relative to the stdlib root (`sysconfig` 'stdlib'); `site-packages`,
`__pycache__` and (by default) the test suites are skipped. The train/validation split is a
deterministic function of the relative path alone (a sha256 bucket), so adding or removing a
file never moves another file between splits.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}


SITE_PREFIX = "site-packages/"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def list_stdlib_files(root: str | os.PathLike | None = None, include_tests: bool = False) -> list[str]:
    """Relative posix paths of the `.py` files under the stdlib root, sorted."""
    root = Path(root) if root is not None else stdlib_root()
    skip = SKIP_DIRS | (set() if include_tests else TEST_DIRS)
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py"):
                out.append((rel_dir / name).as_posix())
    return sorted(out)


def split_bucket(key: str) -> float:
    """A stable number in [0, 1) for a key (sha256 of its UTF-8 bytes)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def split_of(key: str, val_fraction: float) -> str:
    return "validation" if split_bucket(key) < val_fraction else "train"


def val_cap(max_documents: int | None, val_fraction: float) -> int | None:
    """The validation counterpart of a train-side `max_documents` cap (at least 1)."""
    if max_documents is None:
        return None
    return max(1, int(round(max_documents * val_fraction / (1.0 - val_fraction))))


@dataclass
class EmbeddedCorpus:
    """The stdlib corpus, split by path hash. `files(split)` lists relative paths, sorted."""

    val_fraction: float = 0.05
    max_documents: int | None = None  # cap on train documents (validation gets the proportional share)
    include_tests: bool = False
    root: Path | None = None
    include_site_packages: bool = False  # also the installed packages' sources ("site-packages/<path>")

    def __post_init__(self):
        self.root = Path(self.root) if self.root is not None else stdlib_root()
        self._all = list_stdlib_files(self.root, self.include_tests)
        if self.include_site_packages:
            self._all += [f"{SITE_PREFIX}{f}" for f in list_stdlib_files(site_packages_root(), self.include_tests)]
        if not self._all:
            raise FileNotFoundError(f"no Python sources under {self.root}; the embedded corpus needs the stdlib sources")

    def files(self, split: str) -> list[str]:
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        chosen = [f for f in self._all if split_of(f, self.val_fraction) == split]
        cap = self.max_documents if split == "train" else val_cap(self.max_documents, self.val_fraction)
        return chosen[:cap] if cap is not None else chosen

    def path(self, rel: str) -> Path:
        if rel.startswith(SITE_PREFIX):
            return site_packages_root() / rel[len(SITE_PREFIX):]
        return self.root / rel

    def read(self, rel: str) -> str:
        return self.path(rel).read_text(encoding="utf-8", errors="replace")

    def documents(self, split: str) -> list[str]:
        return [self.read(f) for f in self.files(split)]

    def listing_digest(self, split: str) -> str:
        """sha256 over (relative path, size) of a split's files: cheap identity for cache keys."""
        h = hashlib.sha256()
        for f in self.files(split):
            h.update(f"{f}\0{self.path(f).stat().st_size}\n".encode())
        return h.hexdigest()

    @property
    def description(self) -> str:
        v = sys.version_info
        return (
            f"embedded:stdlib-py{v.major}.{v.minor}.{v.micro}:val={self.val_fraction}:"
            f"max_documents={self.max_documents}:tests={self.include_tests}"
            + (":site-packages" if self.include_site_packages else "")
        )
