"""Local cache engine over several devices: one spawned process per device (here two CPU processes)."""

import pytest

from hmscale.teacher.cache import CacheError, build_cache, verify_cache
from hmscale.teacher.cache.build import local_devices
from hmscale.teacher.cache.multiproc import split_round_robin
from hmscale.teacher.cache.worker import FAULT_ENV


def test_split_round_robin_covers_every_shard_once():
    parts = split_round_robin([3, 5, 6, 9, 10], 2)
    assert parts == [[3, 6, 10], [5, 9]]
    assert sorted(sum(split_round_robin(range(11), 4), [])) == list(range(11))


def test_local_devices_default(tools, tmp_path):
    cfg = tools.make_cfg(tmp_path)
    assert local_devices(cfg, device="cpu") == ["cpu"]
    assert len(local_devices(cfg)) == 1  # one process unless the machine has several GPUs


def test_two_processes_write_the_same_bytes_as_one(tmp_path, teacher, data, tools):
    one = build_cache(tools.make_cfg(tmp_path / "one", **{"cache.capture.topk": 4}), data, teacher, engine="local",
                      device="cpu")
    two = build_cache(tools.make_cfg(tmp_path / "two", **{"cache.capture.topk": 4}), data, teacher, engine="local",
                      devices=["cpu", "cpu"])
    assert one.name == two.name
    report = verify_cache(two)
    assert report.ok and len(report.shards_ok) == 4, report.summary()
    shards = lambda d: {k: v for k, v in tools.shard_bytes(d).items() if k.endswith(".tar")}  # noqa: E731
    assert shards(one) == shards(two) and len(shards(one)) == 4


def test_a_dying_worker_stops_the_run_and_a_rerun_finishes(tmp_path, teacher, data, tools, monkeypatch):
    cfg = tools.make_cfg(tmp_path)
    monkeypatch.setenv(FAULT_ENV, f"1:{tmp_path / 'killed.txt'}")  # the worker holding shard 1 dies mid-way
    with pytest.raises(CacheError, match=r"worker 1 on cpu died .*rerun to finish"):
        build_cache(cfg, data, teacher, engine="local", devices=["cpu", "cpu"])
    assert (tmp_path / "killed.txt").exists()
    path = build_cache(cfg, data, teacher, engine="local", devices=["cpu", "cpu"])  # marker exists: no second fault
    assert verify_cache(path).ok


def test_a_capture_function_that_cannot_be_pickled_is_a_clear_error(tmp_path, teacher, data, tools):
    from hmscale.teacher.capture import capture_layers

    cfg = tools.make_cfg(tmp_path)
    with pytest.raises(CacheError, match="cannot be sent to the worker processes"):
        build_cache(cfg, data, teacher, engine="local", devices=["cpu", "cpu"],
                    capture_fn=lambda t, ids, layers=None: capture_layers(t, ids, layers=layers))


def test_a_full_disk_in_a_worker_process_is_named_as_writing(tmp_path, teacher, data, tools, monkeypatch):
    """A file-system error in a spawned worker (a full disk) reaches the driver named as writing the shard, with the
    worker and its device, as on one process; not as a failed teacher forward."""
    (tmp_path / "enospc_capture.py").write_text(
        "import errno\n\n\ndef capture(teacher, ids, layers=None):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned workers take the driver's sys.path
    import enospc_capture

    with pytest.raises(CacheError) as err:
        build_cache(tools.make_cfg(tmp_path / "c"), data, teacher, engine="local", devices=["cpu", "cpu"],
                    capture_fn=enospc_capture.capture, log=lambda *_: None)
    msg = str(err.value)
    assert msg.startswith("writing ") and "(worker " in msg and ", cpu) into " in msg, msg
    assert "No space left on device" in msg and "then rerun `hmscale cache`" in msg and "teacher forward" not in msg
