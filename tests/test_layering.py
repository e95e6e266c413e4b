"""DESIGN.md's layering, checked on the source: imports point down only (lazy, function-level imports included).

    top:    ray_jobs, scaling, hmscale.cli / recipe / report / submit / ray_cluster / run_identity
    3:      hmscale.train, hmscale.eval, hmscale.teacher, hmscale.worker_processes (how their local workers start)
    2:      hmscale.models, hmscale.parallel, hmscale.data
    1:      kernels
    base:   hmscale.config, hmscale.atomic, hmscale.requirements, hmscale.hf_load (importable from every layer)

A package may import its own layer's other packages (train reads the teacher cache) and anything below it."""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"kernels": 1, "hmscale.models": 2, "hmscale.parallel": 2, "hmscale.data": 2, "hmscale.train": 3,
        "hmscale.eval": 3, "hmscale.teacher": 3, "hmscale.worker_processes": 3, "ray_jobs": 4, "scaling": 4,
        "hmscale.cli": 4, "hmscale.recipe": 4,
        "hmscale.report": 4, "hmscale.submit": 4, "hmscale.ray_cluster": 4, "hmscale.run_identity": 4,
        "hmscale.config": 0, "hmscale.atomic": 0, "hmscale.requirements": 0, "hmscale.hf_load": 0}
# the exceptions, each for a stated reason (a new one must be added here, with its own)
ALLOWED = {
    # build_cache(engine="ray") hands the shards to the Ray actors of the top layer, imported when asked for
    ("hmscale/teacher/cache/build.py", "ray_jobs.cache_teacher"),
    # the config refuses an unknown teacher.flavor by name; the registry imports nothing of hmscale
    ("hmscale/config.py", "hmscale.teacher.flavors"),
}
OURS = ("hmscale", "kernels", "ray_jobs", "scaling")


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in OURS:
        return None
    return parts[0] if parts[0] != "hmscale" else ".".join(parts[:2]) if len(parts) > 1 else "hmscale"


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "hmscale":  # from hmscale import parallel
                yield from (f"hmscale.{a.name}" for a in node.names)
            else:
                yield node.module


def _upward_imports():
    bad = []
    for top in OURS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            src = _package(module)
            if src not in RANK:  # the package roots (hmscale/__init__.py, kernels/__init__.py are in RANK's packages)
                continue
            for target in _imports(path):
                dst = _package(target)
                if dst is None or dst == src or dst not in RANK:
                    continue
                if RANK[dst] > RANK[src] and RANK[dst] != 0 and (str(rel), target) not in ALLOWED:
                    bad.append(f"{rel} ({src}, layer {RANK[src]}) imports {target} (layer {RANK[dst]})")
    return bad


def test_every_package_has_a_layer():
    packages = {_package(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"))
                for top in OURS for p in (ROOT / top).rglob("*.py")}
    assert packages - {"hmscale"} <= set(RANK), sorted(packages - {"hmscale"} - set(RANK))


def test_imports_point_down_only():
    assert _upward_imports() == []


def test_the_check_sees_a_lazy_upward_import(tmp_path, monkeypatch):
    """The check itself: a function-level import of the top layer from the models layer is caught."""
    fake = tmp_path / "hmscale" / "models"
    fake.mkdir(parents=True)
    (fake / "x.py").write_text("def f():\n    from ray_jobs.distill import run_distill\n    return run_distill\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _upward_imports() == ["hmscale/models/x.py (hmscale.models, layer 2) imports ray_jobs.distill (layer 4)"]
