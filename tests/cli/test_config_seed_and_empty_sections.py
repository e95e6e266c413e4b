"""Config values a user writes that `hmscale check` accepted (or refused) wrongly: seed range, empty sections."""

import pytest
import yaml

from hmscale.config import ConfigError, build_config, load_config


@pytest.mark.parametrize("override, field", [("seed=-1", "seed"), ("seed=-2", "seed"),
                                             ("cache.capture.seed=-1", "cache.capture.seed"),
                                             ("seed=18446744073709551616", "seed")])
def test_a_seed_numpy_and_torch_cannot_take_is_refused_by_the_config(override, field):
    # `hmscale run -s seed=-1` passed `hmscale check`, prepared the data, then stopped with
    # "hmscale: error: expected non-negative integer" (numpy's, naming no setting) when the teacher's pretraining
    # seeded its generator; cache.capture.seed=-1 the same from the teacher forward ("teacher forward failed on
    # shard-000000.tar: ValueError: expected non-negative integer")
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    assert str(err.value).startswith(f"{field}: ") and "\n" not in str(err.value)
    assert build_config({}, ["seed=0", "cache.capture.seed=0"]).seed == 0
    assert build_config({}, ["seed=123456789"]).seed == 123456789


@pytest.mark.parametrize("text", [
    "stage2:\n  # lr: 3e-4   (every field of the section commented out)\nbudget:\n  total_tokens: 1000\n",
    "stage2:\n  components:\nbudget: {total_tokens: 1000}\n",
    "cache:\n  capture:\nbudget: {total_tokens: 1000}\n",
    "stage2: null\nbudget: {total_tokens: 1000}\n",
])
def test_an_empty_section_in_a_yaml_file_takes_the_defaults(tmp_path, text):
    # a section whose fields are all commented out is YAML's null: the config was refused with
    # "stage2: Input should be a valid dictionary or instance of Stage2Config", and an override into it with
    # "override 'stage2.lr=1e-4': stage2 is not a section" (it is one)
    p = tmp_path / "c.yaml"
    p.write_text(text)
    cfg = load_config(p)
    assert cfg.budget.total_tokens == 1000 and cfg.stage2 == build_config({}).stage2
    assert cfg.cache.capture == build_config({}).cache.capture
    assert load_config(p, ["stage2.lr=1e-4", "stage2.components.gate=false", "cache.capture.topk=4"]).stage2.lr == 1e-4
    assert load_config(p, ["stage2.components.gate=false"]).stage2.components.gate is False
    # a scalar field left empty is still null (teacher.name_or_path: the miniature), and a section given as a value
    # that is not a mapping is still refused
    (tmp_path / "d.yaml").write_text("teacher:\n  name_or_path:\n")
    assert load_config(tmp_path / "d.yaml").teacher.name_or_path is None
    with pytest.raises(ConfigError, match=r"^stage2: Input should be a valid dictionary"):
        build_config({"stage2": 3})


def test_an_empty_section_given_to_build_config_is_not_changed_in_the_callers_tree():
    tree = {"stage2": None, "cache": {"capture": None}}
    assert build_config(tree, ["cache.capture.topk=2"]).cache.capture.topk == 2
    assert tree == {"stage2": None, "cache": {"capture": None}}
    yaml.safe_dump(tree)
