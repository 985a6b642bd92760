"""An exercise not attempted yet says so: a stub's NotImplementedError reaches the student as itself (from a rank,
a RankError naming it), never as a failed comparison or a library error. The checks that run the student's code in
a rank of their own and turn its errors into data (06's recompute, 09's blockwise attention, 11's split backward)
must let it through, as the student copies' runs require (tests/test_notebooks.py)."""
import pytest

from utils.checks.context_parallel import check_blockwise_attention
from utils.checks.mixed_precision import check_recompute
from utils.checks.pipeline import check_backward_split


def stub(*args, **kwargs):
    raise NotImplementedError("your code goes here")


@pytest.mark.parametrize("check", [
    lambda: check_blockwise_attention(stub),
    lambda: check_recompute(stub, hidden_dim=8, num_layers=2, batch_size=4),
    lambda: check_backward_split(stub, stub, 8, 6, 6, 3),
], ids=["blockwise_attention", "recompute", "backward_split"])
def test_a_stub_is_reported_as_not_implemented(check):
    with pytest.raises(Exception) as raised:
        check()
    assert not isinstance(raised.value, AssertionError), raised.value
    assert "NotImplementedError" in f"{type(raised.value).__name__}: {raised.value}", raised.value
