"""Stage 1 with layers spread over 2 workers (each trains only its layers' phi, or with transfer=mixer its
layers' mixers) gives the same per-layer losses as one worker training all layers; the merged export holds
every layer."""

import json

import pytest

pytestmark = pytest.mark.slow


EXPORTS = {"attention": "feature_maps.safetensors", "mixer": "mixers.safetensors"}


def test_layer_parallel_matches_single_worker(launch_job, tmp_path, monkeypatch):
    """Both transfers (attention: the feature maps; mixer: the whole HedgeMamba mixer) in one launch per layout."""
    def common(transfer):
        return ["stage1.steps=5", "stage1.micro_batch_size=4", "stage1.lr=0.05", "stage1.warmup_steps=1",
                "stage1.source=online", "parallel.checkpoint_every=100", "parallel.zero_stage=2",
                f"stage1.transfer={transfer}"]

    lp = ["stage1.layer_parallel=true", "parallel.num_workers=2"]
    # one worker: dist_job's runs in this process (its one-process group), as a one-rank launch runs them
    from tests.train.dist_job import run_one

    monkeypatch.setenv("HMSCALE_NO_PROGRESS", "1")
    ones = [run_one({"overrides": common(t), "run_dir": str(tmp_path / t / "one"), "stage": "stage1"}) for t in EXPORTS]
    twos = launch_job({"runs": [{"overrides": common(t) + lp, "run_dir": str(tmp_path / t / "two"), "stage": "stage1"}
                                for t in EXPORTS]}, world=2)
    for (transfer, export), one, two in zip(EXPORTS.items(), ones, twos):
        _check(tmp_path / transfer, transfer, export, one, two)


def _check(tmp_path, transfer, export, one, two):
    assert len(one) == len(two) == 5 and len(one[0]) == 2, transfer  # 5 steps x 2 layers
    for a, b in zip(one, two):
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-4 * abs(x) + 1e-9, (transfer, one, two)
    assert one[-1] != one[0]
    meta = json.loads((tmp_path / "two" / "stage1" / "summary.json").read_text())
    assert meta["layer_parallel"] and meta["done"]
    # each layer trained on the same tokens (the budget's unit), so the same count: layer-parallel workers read the
    # same rows (it counted them once per worker, and a budget gave each layer 1/workers of its tokens)
    assert meta["tokens"] == json.loads((tmp_path / "one" / "stage1" / "summary.json").read_text())["tokens"]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "one" / "stage1" / "student" / export))
    b = load_file(str(tmp_path / "two" / "stage1" / "student" / export))
    assert sorted(a) == sorted(b)
    assert {k.split(".", 1)[0] for k in a} == {"0", "1"}  # both layers, whichever worker trained them
    if transfer == "attention":
        assert sorted(a) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    else:  # the conv, decay and gate moved too, not only the feature maps
        assert any("conv" in k for k in a) and any("feature_map" in k for k in a)
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-3 * a[k].abs().max() + 1e-6, k
