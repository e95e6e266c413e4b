"""kernels.settings: switches read once inside env_frozen (per SSD call), straight from os.environ outside it."""

from kernels.settings import env, env_frozen


def test_env_reads_live_outside_and_once_inside_a_frozen_block(monkeypatch):
    monkeypatch.setenv("HMSCALE_SSD_TEST_SWITCH", "a")
    assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "a"
    monkeypatch.setenv("HMSCALE_SSD_TEST_SWITCH", "b")
    assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"  # outside a block: every read is live
    with env_frozen():
        assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"
        monkeypatch.setenv("HMSCALE_SSD_TEST_SWITCH", "c")
        assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"  # remembered for the rest of the call
        with env_frozen():  # nested: the same memo
            assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "b"
        monkeypatch.delenv("HMSCALE_SSD_TEST_ABSENT", raising=False)
        assert env("HMSCALE_SSD_TEST_ABSENT", "dflt") == "dflt"
        monkeypatch.setenv("HMSCALE_SSD_TEST_ABSENT", "now")
        assert env("HMSCALE_SSD_TEST_ABSENT", "dflt") == "dflt"  # absence is remembered too
    assert env("HMSCALE_SSD_TEST_SWITCH", "d") == "c"  # the next call sees the change
    assert env("HMSCALE_SSD_TEST_ABSENT", "dflt") == "now"
