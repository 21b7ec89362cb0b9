"""A split past its deadline (C++ Note [nccl parts]): at W = 1 no rank can stay away, so the
deadline is made shorter than a split takes (1 ms). The timeout names the group and the rank, and
the parent refuses every later split, saying why. Its own file and gpu_check.sh step
(nccl_split_timeout): the half-made communicator is left to the process's exit, as a timed-out
init is, so a crash there could not hide the other W = 1 results."""
import pytest

import zerort
from zerort import _C


def test_a_split_past_its_timeout_names_the_group_and_retires_the_parent():
    """A split that finishes within 1 ms never reaches the path: the test then skips."""
    parent = _C.make_nccl_communicator(0, 1, 0, _C.nccl_unique_id(), 20.0, False)
    try:
        _C.make_nccl_part(parent, 0, 0, "row 0 of 1 (ranks 0)", 0.001, False)
    except zerort.CommTimeoutError as e:
        assert "splitting off row 0 of 1 (ranks 0) on rank 0 of 1 (color 0, key 0): the group did not form " \
               "within 1 ms" in str(e)
    else:
        pytest.skip("the split finished within 1 ms: the timeout path was not reached")
    with pytest.raises(zerort.Error, match=r"aborted after an earlier failure \(NCCL: splitting off row 0 of 1 "
                                           r"\(ranks 0\) on rank 0 of 1 \(color 0, key 0\) timed out\)"):
        _C.make_nccl_part(parent, 0, 0, "row 0 of 1 (ranks 0)", 20.0, False)
