"""Stage 1's start event counts the stage's trainable parameters whatever the layout: layer-parallel workers each
hold only their layers (3 layers on 2 workers: rank 0 holds two, rank 1 one), and the logged count was rank 0's.
Run as a script, this file is the job: one online stage 1 on a seeded random 3-layer teacher (RANK / WORLD_SIZE in
the environment; tests/train/conftest.py `launch`)."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

LAYERS = 3


def _teacher():
    from transformers import GPTNeoXForCausalLM

    from hmscale.teacher.flavors import neox_config

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(neox_config("pythia-nano", vocab_size=96, num_hidden_layers=LAYERS)).eval()


def _job(spec_path):
    torch.set_num_threads(1)
    os.environ.setdefault("HMSCALE_NO_PROGRESS", "1")
    from hmscale.config import build_config
    from hmscale.train.data import ArraySource
    from hmscale.train.stage1 import run_stage1

    spec = json.loads(Path(spec_path).read_text())
    toks = np.random.default_rng(1).integers(0, 96, size=(16, 32))
    for run in spec["runs"]:
        run_stage1(build_config({}, run["overrides"]), run["run_dir"], teacher=_teacher(), source=ArraySource(toks),
                   resume=False, export=False)
    if int(os.environ["RANK"]) == 0:
        Path(spec["out"]).write_text("[]")


TRANSFERS = ["attention", "mixer"]


def _common(transfer):
    return ["stage1.steps=1", "stage1.micro_batch_size=4", "stage1.source=online", "parallel.zero_stage=2",
            f"stage1.transfer={transfer}"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Both transfers' layer-parallel stage 1, one after the other in one 2-rank launch (process start-up is most of
    a launch's time); the directory holding each transfer's run directory."""
    from tests.train.conftest import launch

    tmp = tmp_path_factory.mktemp("layer_parallel_count")
    runs = [{"overrides": _common(t) + ["stage1.layer_parallel=true", "parallel.num_workers=2"],
             "run_dir": str(tmp / t / "two")} for t in TRANSFERS]
    launch({"runs": runs}, 2, tmp, job=Path(__file__))
    return tmp


@pytest.mark.xdist_group("layer_parallel_count")  # (both cases on one pytest worker: one launch)
@pytest.mark.parametrize("transfer", TRANSFERS)
def test_layer_parallel_start_event_counts_every_layers_parameters(launched, transfer):
    from hmscale.config import build_config
    from hmscale.models.convert import to_hedgehog, to_mixer_student
    from hmscale.train.engine import read_metrics

    common = _common(transfer)
    # the reference, by hand: what trains in stage 1 is every layer's feature map (transfer=attention) or every
    # layer's mixer parameters that require grad (transfer=mixer)
    if transfer == "attention":
        owned = list(to_hedgehog(_teacher()).feature_maps)
    else:
        model = to_mixer_student(_teacher(), build_config({}, common).stage2.components, None)
        owned = [layer.mixer for layer in model.backbone.layers]
    want = sum(p.numel() for m in owned for p in m.parameters() if p.requires_grad)
    assert len(owned) == LAYERS and want > 0
    (event,) = read_metrics(launched / transfer / "two" / "stage1" / "metrics.jsonl", kind="event")
    assert event["layer_parallel"] is True
    assert event["trainable_params"] == want, (event, want)


if __name__ == "__main__":
    _job(sys.argv[1])
