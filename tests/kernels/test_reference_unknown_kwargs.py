"""The public PyTorch SSD functions took ``**_ignored``: mamba_ssm's spellings (``initial_states=``,
``return_final_states=True``) or any typo were silently dropped, so the call ran without the initial state and
returned y alone (``y, s = ...`` then split y along the batch, silently). An unknown keyword is a TypeError now, as
for ``kernels.ssd``; ``chunk_size`` stays accepted (and ignored by the quadratic / token-loop references)."""

import pytest
import torch

from kernels import ssd_chunked_torch, ssd_recurrent_reference, ssd_reference

from ._helpers import make_inputs


@pytest.mark.parametrize("fn", [ssd_reference, ssd_recurrent_reference, ssd_chunked_torch])
@pytest.mark.parametrize("bad", [dict(initial_states="S0"), dict(return_final_states=True), dict(normalise=True)])
def test_an_unknown_keyword_is_refused(fn, bad):
    ins, _ = make_inputs(2, 7, 2, 1, 3, 4, init=True)
    s0 = ins.pop("initial_state")
    bad = {k: (s0 if v == "S0" else v) for k, v in bad.items()}
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        fn(**ins, **bad)


@pytest.mark.parametrize("fn", [ssd_reference, ssd_recurrent_reference, ssd_chunked_torch])
def test_the_known_keywords_still_work(fn):
    ins, seq = make_inputs(2, 7, 2, 1, 3, 4, init=True, D=True, seq=True)
    y, s = fn(**ins, chunk_size=4, seq_idx=seq, normalize=False, return_final_state=True)
    yr, sr = ssd_recurrent_reference(**ins, seq_idx=seq, return_final_state=True)
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(s, sr)
