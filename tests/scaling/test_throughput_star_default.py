"""A measured-throughput table's ``"*"`` row is the default of every size, stage by stage."""

import pytest

from scaling.planner import PlanSettings, plan_size, tokens_per_second


def test_star_fills_the_stages_a_size_row_does_not_give():
    """`{"*": {cache, stage1, stage2}, "pythia-1b": {"stage2": ..}}` (README's own example shape) planned 1b's cache and
    stage 1 with the FLOP model: a size's own row hid every stage of "*"."""
    star = {"cache": 1.0e5, "stage1": 2.0e5, "stage2": 3.0e4}
    own = {"stage2": 2.5e4}
    s = PlanSettings(throughput={"*": star, "pythia-1b": own})
    got = tokens_per_second("pythia-1b", s)
    assert got == {**star, **own}  # the size's own number wins, "*" fills the rest
    assert tokens_per_second("pythia-410m", s) == star
    p = plan_size("pythia-1b", s)
    for st, tps in {**star, **own}.items():  # GPU-hours = tokens of the stage / (tokens/s) / 3600
        toks = {"cache": p.stage1_tokens, "stage1": p.stage1_tokens, "stage2": p.stage2_tokens}[st]
        assert p.gpu_hours[st] == pytest.approx(toks / tps / 3600)
    assert p.throughput_source == "measured"


def test_a_stage_neither_row_gives_still_comes_from_the_model():
    model = tokens_per_second("pythia-1b", PlanSettings())
    got = tokens_per_second("pythia-1b", PlanSettings(throughput={"*": {"cache": 1.0e5}, "pythia-1b": {"stage2": 2.5e4}}))
    assert got == {"cache": 1.0e5, "stage1": model["stage1"], "stage2": 2.5e4}
