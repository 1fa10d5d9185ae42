"""Fixtures of the expert-parallel tests: the NCCL world of one process (one GPU)."""
import datetime

import pytest
import torch
import torch.distributed as dist

from helpers.dist import free_port


@pytest.fixture(scope="module")
def group():
    """An NCCL group of this one process (the world, or a new group when another test module
    already initialised a world of one); destroyed at the end when created here."""
    torch.cuda.set_device(0)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120),
                                device_id=torch.device("cuda", 0))
        pg = dist.group.WORLD
    else:
        if dist.get_world_size() != 1:
            pytest.skip("these tests run in a world of one process")
        pg = dist.new_group([0], backend="nccl")
    yield pg
    torch.cuda.synchronize()
    if created:
        dist.destroy_process_group()
