"""A missing peer: rank 0 of a 2-rank NCCL communicator whose rank 1 never comes. The
nonblocking initialisation must give up after comm.timeout_s with an error that says so,
and abort the communicator instead of hanging (gpu_check.sh also bounds this step)."""
import pytest

import zerort


def test_nccl_init_without_peer_times_out_and_aborts():
    with pytest.raises(zerort.Error,
                       match="could not create the communicator within 3000 ms"):
        zerort._C.make_nccl_communicator(0, 2, 0, zerort._C.nccl_unique_id(), 3.0, True)
