"""hmscale: distil Pythia / GPT-NeoX into pure Mamba-2 (SSD) models with the HedgeMamba recipe."""

import importlib.util as _ilu
from pathlib import Path as _Path

__version__ = "0.1.0"


def _check_kernels_package() -> None:
    """hmscale's SSD kernels live in the top-level package ``kernels`` (DESIGN.md's contract ``kernels.ssd``).
    Hugging Face's hub-kernels distribution has the same import name; where it is installed too, one of the two
    hides the other. Say so in one line instead of failing later with an unrelated AttributeError."""
    spec = _ilu.find_spec("kernels")
    origin = getattr(spec, "origin", None) if spec is not None else None
    if origin is None or not (_Path(origin).parent / "ssd_autograd.py").is_file():
        raise ImportError(
            f"'import kernels' finds {origin or 'nothing'}, not hmscale's SSD kernels package (the Hugging Face "
            "'kernels' distribution has the same import name): run 'pip uninstall kernels' in this environment, "
            "or reinstall hmscale ('pip install -e .' from its checkout)")


_check_kernels_package()
