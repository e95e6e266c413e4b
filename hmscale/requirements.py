"""hmscale's declared runtime requirements, read without importing any of them (standard library only: the job's
dependency check runs before the dependencies are known to be there)."""

from __future__ import annotations

import re
from pathlib import Path


def distribution_name(spec: str) -> str:
    """'ray[default,train]>=2.40' -> 'ray'."""
    return re.split(r"[\[<>=!~; ]", spec.strip(), maxsplit=1)[0].lower()


def pyproject_dependencies(checkout: str | Path) -> list[str] | None:
    """``project.dependencies`` of ``checkout``/pyproject.toml; None where it is missing or unreadable (or Python 3.10,
    which has no tomllib)."""
    try:
        import tomllib

        return list(tomllib.loads((Path(checkout) / "pyproject.toml").read_text())["project"]["dependencies"])
    except (ImportError, OSError, KeyError, ValueError):
        return None
