"""deepspeed.comm's rank queries, apart from its collectives so that deepspeed.utils' logging
can ask them without importing zerort.integrations.deepspeed.comm (which logs through it)."""
import torch.distributed as dist

from zerort import comm as zerort_comm


def get_rank(group=None):
    """This process's rank: torch.distributed's once a group exists, the launcher's before."""
    return dist.get_rank(group) if dist.is_initialized() else zerort_comm.detect_launch_env()["rank"]


def get_world_size(group=None):
    return dist.get_world_size(group) if dist.is_initialized() else zerort_comm.detect_launch_env()["world_size"]


def get_local_rank():
    return zerort_comm.detect_launch_env()["local_rank"]
