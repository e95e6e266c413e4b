"""transformers' ``from_pretrained``, one load at a time per process.

While it loads, transformers swaps ``PreTrainedModel.tie_weights`` for a no-op for the whole process (a class
attribute: ``transformers.initialization.no_tie_weights``), then puts back what it found. Two loads overlapping in
threads (two runs sharing a teacher in one process) leave the no-op for good, and every tied model built afterwards in
that process comes out untied. Every model load in hmscale goes through :func:`from_pretrained`, which holds a lock.
"""

from __future__ import annotations

import threading

_LOCK = threading.RLock()


def from_pretrained(cls, *args, **kwargs):
    """``cls.from_pretrained(*args, **kwargs)`` under the process's load lock."""
    with _LOCK:
        return cls.from_pretrained(*args, **kwargs)
