"""hmscale.hf_load.from_pretrained: loads one at a time, so that overlapping loads in threads cannot leave
transformers' PreTrainedModel.tie_weights patched to a no-op (found: tests/teacher/test_concurrent_pretrain.py
did, and a later tied conversion in that worker came out untied)."""

import threading
import time

from transformers.initialization import no_tie_weights
from transformers.modeling_utils import PreTrainedModel

from hmscale.hf_load import from_pretrained


class SlowLoad:
    """Stands in for a model class: its load holds transformers' no_tie_weights, as from_pretrained does."""

    @classmethod
    def from_pretrained(cls, name):
        with no_tie_weights():
            time.sleep(0.3)
        return name


def test_overlapping_loads_leave_tie_weights_as_they_found_it():
    real = PreTrainedModel.tie_weights
    out = []
    try:
        threads = [threading.Thread(target=lambda n=n: out.append(from_pretrained(SlowLoad, n))) for n in "ab"]
        threads[0].start()
        time.sleep(0.1)  # the second load starts while the first holds the patch
        threads[1].start()
        for t in threads:
            t.join(10)
        assert sorted(out) == ["a", "b"]
        assert PreTrainedModel.tie_weights is real
    finally:
        PreTrainedModel.tie_weights = real
