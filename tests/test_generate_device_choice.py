"""`hmscale generate --device`: a device type it does not run on is refused in one line, the documented ones taken."""

from __future__ import annotations

import pytest
import torch

from hmscale.cli import main
from hmscale.eval.generation import resolve_device


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_generate_refuses_a_device_type_it_does_not_run_on_in_one_line(device):
    """README: `hmscale generate ... --device auto|cpu|cuda[:N]`. `--device mps` (a torch device name, but not one
    generate runs on) loaded the model, then ended in a traceback from the first copy to the device."""
    with pytest.raises(ValueError, match=rf"--device: '{device}' is not a device generate runs on; use auto, cpu, "
                                         r"cuda or cuda:N"):
        resolve_device(device)


def test_generate_cli_says_so_before_loading_anything(tmp_path, capsys):
    # (the device is checked before the model directory: a missing one would otherwise answer first)
    assert main(["generate", str(tmp_path / "missing"), "--device", "mps"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device: 'mps' is not a device generate runs on" in err


def test_generate_still_takes_the_documented_devices():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU"):
            resolve_device("cuda:0")
