"""labels= together with logits_to_keep: the loss of the kept positions, or one line saying what to change."""
import pytest
import torch
import torch.nn.functional as F

from ._helpers import perturbed_hedgemamba

VOCAB = 97


def test_an_int_logits_to_keep_gives_the_next_token_loss_inside_the_kept_positions():
    model = perturbed_hedgemamba(VOCAB)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        for k in (5, 12, 30):
            out = model(ids, labels=ids, logits_to_keep=k)
            kk = min(k, ids.shape[1])
            assert out.logits.shape[1] == kk
            want = F.cross_entropy(full[:, -kk:-1].reshape(-1, VOCAB).float(), ids[:, -kk + 1:].reshape(-1))
            torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
        # 0 keeps every position: the usual loss
        torch.testing.assert_close(model(ids, labels=ids, logits_to_keep=0).loss,
                                   F.cross_entropy(full[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1)))


def test_labels_with_positions_as_a_tensor_or_of_another_length_are_one_line_errors():
    model = perturbed_hedgemamba(VOCAB)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"^labels=: not with logits_to_keep given as a tensor"):
            model(ids, labels=ids, logits_to_keep=torch.tensor([1, 4, 6]))
        with pytest.raises(ValueError, match=r"^labels=: 6 positions for 8 positions of logits"):
            model(ids, labels=ids[:, :6])
