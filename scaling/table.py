"""Results tables: CSV and JSON, written atomically (a reader never sees a partial file)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from hmscale.atomic import atomic_write_json, atomic_write_text


def columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def write_csv(path: str | Path, rows: list[dict], cols: list[str] | None = None) -> Path:
    cols = cols or columns(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return atomic_write_text(path, buf.getvalue())


def write_json(path: str | Path, rows) -> Path:
    return atomic_write_json(path, json.loads(json.dumps(rows, default=str)))


def read_csv(path: str | Path) -> list[dict]:
    with Path(path).open() as fh:
        return list(csv.DictReader(fh))
