"""The one-rank gloo process group (a module fixture) that the load-balancing tests need."""
import contextlib
import os
import socket

import pytest
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_world():
    """torch.distributed's WORLD group of a one-rank gloo job, made here unless a group is up
    already (then left as it is), destroyed on exit if made here."""
    created = False
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        created = True
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def world_group():
    """torch.distributed's WORLD group of a one-rank gloo job (destroyed after the module)."""
    with one_rank_world() as group:
        yield group
