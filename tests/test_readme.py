"""The README's config reference is the one the config tree generates (no drift)."""

from pathlib import Path

from hmscale.config import config_reference

README = Path(__file__).resolve().parents[1] / "README.md"


def test_config_reference_in_readme_is_current():
    text = README.read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == config_reference(), "regenerate it: python -m hmscale.config"


def test_readme_shows_the_two_commands():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
