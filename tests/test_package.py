"""The package's import-time check that ``kernels`` is hmscale's own SSD package."""

import subprocess
import sys


def test_a_shadowing_kernels_package_stops_import_with_a_clear_error(tmp_path):
    fake = tmp_path / "shadow" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("CUDAProperties = object\n")  # what the hub's package exports, not ours
    env = {"PYTHONPATH": str(fake.parent), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import hmscale"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: 'import kernels' finds ") and str(fake / "__init__.py") in last
    assert "pip uninstall kernels" in last


def test_hmscale_finds_its_own_kernels_package(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import hmscale, kernels; print(callable(kernels.ssd))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
