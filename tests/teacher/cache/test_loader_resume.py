"""Resuming a CacheLoader gives exactly the batches the uninterrupted loader gives next: with DataLoader workers (any
number of them, resumed at any position) and right after an epoch's last batch."""

import pytest
import torch

from hmscale.teacher.cache import CacheReader, build_cache


@pytest.fixture
def reader(tmp_path, teacher, tools):
    data = tools.make_data(shards=3, per_shard=6)  # 18 rows: 9 batches of 2 per epoch
    cfg = tools.make_cfg(tmp_path, **{"cache.capture.layers": "[0]", "cache.capture.tensors": "[attn_input]"})
    return CacheReader(build_cache(cfg, data, teacher, engine="local", log=lambda *_: None))


def _keys(batches):
    return [b["keys"] for b in batches]


@pytest.mark.parametrize("workers,start", [(2, 3), (2, 4), (3, 5), (3, 1)])
def test_a_resumed_loader_in_dataloader_workers_continues_in_order(reader, workers, start):
    # the reference: the same epoch read in this process, uninterrupted
    want = _keys(reader.stage2_batches(2, seed=1))[start:]
    ld = reader.stage2_batches(2, seed=1, start=start)
    dl = torch.utils.data.DataLoader(ld, batch_size=None, num_workers=workers, multiprocessing_context="fork")
    assert _keys(dl) == want


def test_state_saved_after_an_epochs_last_batch_resumes_at_the_next_epoch(reader):
    ld = reader.stage2_batches(2, seed=1)
    it = iter(ld)
    nb = len(ld)
    for _ in range(nb):  # every batch of epoch 0 consumed; the loop never asked for one more
        next(it)
    state = ld.state_dict()
    uninterrupted = _keys(b for _, b in zip(range(nb), it))  # what this loader gives next (an exhausted generator)
    uninterrupted += _keys(b for _, b in zip(range(3), ld))  # ... then, iterated again, epoch 1
    resumed = reader.stage2_batches(2, seed=1)
    resumed.load_state_dict(state)
    assert _keys(b for _, b in zip(range(3), resumed)) == uninterrupted
    assert uninterrupted == _keys(reader.stage2_batches(2, seed=1, epoch=1))[:3]


@pytest.mark.parametrize("start", [-1, 10])
def test_a_start_outside_the_epoch_is_refused(reader, start):
    with pytest.raises(ValueError, match="start"):
        reader.stage2_batches(2, seed=1, start=start)


def test_set_epoch_drives_passes_over_dataloader_workers(reader):
    """Non-persistent DataLoader workers advance their copies of the loader, not the loader: every pass read epoch 0
    again. set_epoch(e) before each pass reads epoch e, as the loader iterated in this process does."""
    here = reader.stage2_batches(2, seed=1)
    want = [_keys(here) for _ in range(3)]  # in this process: epochs 0, 1, 2, one after the other
    assert want[0] != want[1]
    ld = reader.stage2_batches(2, seed=1)
    dl = torch.utils.data.DataLoader(ld, batch_size=None, num_workers=2, multiprocessing_context="fork")
    got = []
    for e in range(3):
        ld.set_epoch(e)
        got.append(_keys(dl))
    assert got == want
    ld.set_epoch(1, 4)
    assert _keys(dl) == want[1][4:]
    with pytest.raises(ValueError, match="set_epoch"):
        ld.set_epoch(0, len(ld) + 1)
