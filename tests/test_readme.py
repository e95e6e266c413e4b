"""The user-facing docs (README.md, docs/CACHE_FORMAT.md, scaling/README.md) name only what exists (no drift): the
config reference is the one the config tree generates, every `section.field`, command, option, path, Makefile target
and HMSCALE_* variable they name is real, every variable the code reads is documented, and the cache format's field
table and manifest keys are the writer's. Fast: no training, no Ray."""

import re
from pathlib import Path

import pytest

from hmscale.config import RunConfig, config_reference

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CACHE_FORMAT = REPO / "docs" / "CACHE_FORMAT.md"
SCALING = REPO / "scaling" / "README.md"
DOCS = (README, CACHE_FORMAT, SCALING)


def _fields() -> set[str]:
    """Every dotted config name: sections and fields."""
    from pydantic import BaseModel

    out: set[str] = set()

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            out.add(prefix + name)
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig, "")
    return out


def _code_block_after(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("```", 2)[1]


def test_config_reference_in_readme_is_current():
    text = README.read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == config_reference(), "regenerate it: python -m hmscale.config"


def test_config_reference_shows_types_and_bounds_readably():
    table = config_reference()
    assert "Union[" not in table and "Optional[" not in table and "typing" not in table
    assert '| `cache.engine` | "local" or "ray" or None | `null` |  |' in table
    assert "| `tokenizer.vocab_size` | int | `2048` | `>= 260` |" in table
    assert "| `data.val_fraction` | float | `0.05` | `> 0, < 1` |" in table


def test_every_config_field_the_docs_name_exists():
    fields = _fields()
    not_config = {"teacher.fingerprint"}  # the cache manifest's key, in docs/CACHE_FORMAT.md
    pattern = re.compile(r"(?<![\w./-])((?:teacher|tokenizer|data|cache|budget|stage1|stage2|parallel|eval)"
                         r"(?:\.[a-z0-9_]+)+)(?![\w(])")
    unknown = set()
    for doc in DOCS:
        for m in pattern.finditer(doc.read_text()):
            name = m.group(1).rstrip(".")
            if name not in fields and name not in not_config and not name.endswith((".py", ".md", ".json")):
                unknown.add(f"{doc.name}: {name}")
    assert not unknown, f"settings the docs name that the config does not have: {sorted(unknown)}"


def _commands():
    import typer

    from hmscale.cli import app

    return typer.main.get_command(app).commands


def _options(command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def test_commands_block_names_real_commands_and_their_options():
    commands = _commands()
    block = _code_block_after(README.read_text(), "## Commands")
    current, seen = None, []
    for line in block.splitlines():
        words = line.split("  ")[0].split()  # the command, before its description
        if words and words[0] == "hmscale":
            current = commands.get(words[1])
            assert current is not None, f"README's Commands names `hmscale {words[1]}`, which does not exist"
            seen.append(words[1])
            if hasattr(current, "commands"):  # a group: `hmscale scale plan | run`
                assert {w for w in words[2:] if w != "|"} <= set(current.commands), line
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
            assert flag in _options(current), f"README's Commands gives {flag} to `hmscale {seen[-1]}`, which has none"
    assert set(seen) == set(commands), f"commands missing from README's Commands: {set(commands) - set(seen)}"


def test_scaling_readme_synopsis_names_real_options():
    import inspect

    import ray_jobs.scaling

    scale = _commands()["scale"].commands
    block = _code_block_after(SCALING.read_text(), "# scaling")
    current = None
    for line in block.splitlines():
        words = line.split()
        if words[:2] == ["hmscale", "scale"]:
            current = _options(scale[words[2]])
        elif words[:3] == ["python", "-m", "ray_jobs.scaling"]:
            current = set(re.findall(r'"(--[a-z-]+)"', inspect.getsource(ray_jobs.scaling.parse_args)))
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line.split("#")[0]):
            assert flag in current, f"scaling/README.md: {flag} is not an option there ({line.strip()[:60]})"
    shown = set(re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", block))
    for name in ("plan", "run"):  # and the synopsis shows every option (but --help), in its long or short form
        missing = [p.opts[0] for p in scale[name].params if p.opts[0].startswith("-") and p.opts[0] != "--help"
                   and not set(p.opts) & shown]
        assert not missing, f"scaling/README.md's synopsis lacks `hmscale scale {name}` {missing}"


# a path in the repository (or the workspace's ../shared), or a script named alone (found where the docs keep them)
_TOP = r"(?:\.\./shared|benchmarks|tests|hmscale|kernels|scaling|ray_jobs|ds_configs|configs|docs|calibration)"
_PATH = re.compile(rf"(?<![\w/.-])({_TOP}/(?:[\w./*-]*[\w*/])?)|`([\w-]+\.(?:py|sh))`")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_paths_the_docs_name_exist(doc):
    missing = []
    for m in _PATH.finditer(doc.read_text()):
        path = (m.group(1) or m.group(2)).rstrip(".")
        if path.startswith("../shared/") and not (REPO / "../shared").is_dir():
            continue  # the workspace's shared folder, beside the checkout (a clone elsewhere has none)
        bases = [REPO, doc.parent, REPO / "benchmarks", REPO / "hmscale" / "teacher" / "cache"]
        if not any(list(b.glob(path)) if "*" in path else (b / path).exists() for b in bases):
            missing.append(path)
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_benchmark_options_the_docs_give_exist():
    """`benchmarks/X.py --flag ...` in one code span: each flag is one the script parses."""
    for doc in DOCS:
        for script, args in re.findall(r"`(?:python3? )?(benchmarks/[\w.]+\.py)([^`]*)`", doc.read_text()):
            source = (REPO / script).read_text()
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", args):
                assert f'"{flag}"' in source, f"{doc.relative_to(REPO)}: {script} has no option {flag}"


def test_make_targets_and_variables_the_readme_names_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    variables = set(re.findall(r"^(\w+)\s*\?=", makefile, re.M))
    text = README.read_text()
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", text))
    assert {"demo", "test"} <= named <= targets, f"README names make targets the Makefile lacks: {named - targets}"
    for var in ("TORCH", "TORCH_INDEX", "ARGS", "TEST_WORKERS"):  # the knobs the README explains
        assert f"{var}=" in text and var in variables, var


# read by the code, not for users: test hooks, the job's config and the submitted directory from `hmscale submit`, and
# the sweep's thread
# override (CPU training takes its threads from the task's CPUs instead: `hmscale.ray_cluster.process_cpus`), and
# the marker of a one-process group init_distributed made itself (its children make their own)
_INTERNAL_ENV = {"HMSCALE_CACHE_FAULT", "HMSCALE_FAULT_INJECT", "HMSCALE_CONFIG_B64", "HMSCALE_SUBMITTED_FROM",
                 "HMSCALE_SINGLE_PROCESS_GROUP_PORT"}


def _env_in_code() -> set[str]:
    names = set()
    for pkg in ("hmscale", "kernels", "ray_jobs", "scaling"):
        for f in (REPO / pkg).rglob("*.py"):
            names |= set(re.findall(r"HMSCALE_[A-Z0-9_]*[A-Z0-9](?![\w*])", f.read_text()))
    return names


def test_every_environment_variable_the_code_reads_is_documented_and_back():
    code = _env_in_code()
    docs = set()
    for doc in DOCS:
        docs |= set(re.findall(r"HMSCALE_[A-Z0-9_]*[A-Z0-9](?![\w*])", doc.read_text()))
    assert not (code - _INTERNAL_ENV) - docs, f"HMSCALE_* variables the docs never name: {sorted(code - _INTERNAL_ENV - docs)}"
    assert not docs - code, f"HMSCALE_* variables the docs name that no code reads: {sorted(docs - code)}"


def test_cache_format_field_table_is_the_writers_layout():
    from hmscale.teacher.cache.format import FORMAT_VERSION, TENSORS, CaptureSpec, TeacherShape, layout

    text = CACHE_FORMAT.read_text()
    assert text.startswith(f"# Teacher cache format — version {FORMAT_VERSION}\n")
    table = text.split("### Fields of one sample", 1)[1].split("###", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = cells[1]
    wide = TeacherShape(n_layers=2, d_model=64, n_heads=4, vocab_size=70000)
    narrow = TeacherShape(n_layers=2, d_model=64, n_heads=4, vocab_size=300)
    for dtype in ("bfloat16", "float32", "fp8_e4m3"):
        for topk_dtype in ("float16", "bfloat16"):
            spec = CaptureSpec(layers=(0, 1), tensors=TENSORS, dtype=dtype, token_fraction=0.5, topk=4,
                               topk_dtype=topk_dtype)
            for shape in (wide, narrow):
                for name, f in layout(spec, shape, 32).items():
                    doc_name = re.sub(r"^l\d{3}_", "lNNN_", name)
                    assert doc_name in rows, f"docs/CACHE_FORMAT.md's field table lacks {doc_name}"
                    if rows[doc_name] != "storage":  # (layer tensors: the storage dtype, listed below the table)
                        assert f"`{f.npy_dtype}`" in rows[doc_name], (doc_name, f.npy_dtype, rows[doc_name])


def test_cache_format_manifest_example_has_the_writers_keys(tmp_path):
    import json

    from hmscale.teacher.cache.manifest import Manifest

    text = CACHE_FORMAT.read_text()
    example = json.loads(_code_block_after(text, "## Manifest").removeprefix("json\n"))
    written = Manifest.new(tmp_path, key="k", teacher={}, plan={}, capture={}, layout={}, config_hash="h").data
    assert set(example) == set(written), f"manifest keys: the example has {sorted(set(example) ^ set(written))} wrong"
    assert set(example["shards"]["0"]) == {"file", "sha256", "bytes", "samples", "tokens"}
