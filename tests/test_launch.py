"""fdp.init_distributed: torchrun's environment, the device, threads, and a fresh store per attempt.

The restarts themselves (torchrun killing and restarting real workers, on one
and on two agents) are in tests/test_examples.py and tests/test_checkpoint.py.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

import fdp
from fdp._comm import _launch
from tests import ranks

TIMEOUT = datetime.timedelta(seconds=20)


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What torchrun sets for rank 0 of a one-process job on a node of two."""
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(ranks.free_port()),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_outside_torchrun_names_the_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"^fdp.init_distributed: the environment lacks RANK"):
        fdp.init_distributed()
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
@pytest.mark.usefixtures("torchrun_env")
def test_nccl_without_cuda_is_refused_before_any_group() -> None:
    message = r"`backend` is 'nccl', which runs on cuda devices, but torch.cuda.is_available"
    with pytest.raises(ValueError, match=message):
        fdp.init_distributed("nccl")
    assert not dist.is_initialized()


@pytest.mark.usefixtures("torchrun_env")
def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`backend` is 'glo', which this torch build does not"):
        fdp.init_distributed("glo")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_rank_takes_cuda_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(ValueError, match=r"LOCAL_RANK is \d+, but only \d+ cuda devices"):
        _launch._device("nccl", torch.cuda.device_count())
    assert _launch._device("nccl", 0) == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0


@pytest.mark.usefixtures("torchrun_env")
def test_gloo_returns_the_cpu_and_shares_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(7)
    device = fdp.init_distributed("gloo", timeout=TIMEOUT)
    assert device == torch.device("cpu")
    assert (dist.get_world_size(), dist.get_backend()) == (1, "gloo")
    assert torch.get_num_threads() == max(1, _launch.usable_cpus() // 2)  # LOCAL_WORLD_SIZE 2
    with pytest.raises(RuntimeError, match="already initialized"):
        fdp.init_distributed("gloo")
    x = torch.ones(3)
    dist.all_reduce(x)
    torch.testing.assert_close(x, torch.ones(3))


@pytest.mark.usefixtures("torchrun_env")
def test_omp_num_threads_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch made of the variable at its start
    fdp.init_distributed("gloo", timeout=TIMEOUT)
    assert torch.get_num_threads() == 3


def test_usable_cpus_is_within_the_affinity() -> None:
    assert 1 <= _launch.usable_cpus() <= len(os.sched_getaffinity(0))


# ---------------------------------------------------------------------------
# A fresh key space per attempt, on one store kept across attempts (as torchrun's agent keeps it).


def _attempt(port: int, world: int, label: str) -> list[str]:
    """Every rank of one attempt runs attempt_store concurrently; returns what each sees."""

    def rank(r: int) -> str:
        store = TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
        fresh = _launch.attempt_store(store, r, world, TIMEOUT)
        fresh.set(f"address/{r}", f"{label} {r}")
        # What gloo does: read every peer's address from the group's store.
        return ",".join(fresh.get(f"address/{p}").decode() for p in range(world))

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(rank, r) for r in range(world)]
        return [f.result(timeout=60) for f in futures]


def test_each_attempt_gets_keys_no_earlier_attempt_wrote() -> None:
    port = ranks.free_port()
    server = TCPStore("127.0.0.1", port, None, is_master=True, timeout=TIMEOUT)
    world = 3
    assert _attempt(port, world, "dead") == ["dead 0,dead 1,dead 2"] * world
    # The first attempt's hellos and addresses are still in the store: a rank
    # that read them would connect to the dead ranks (what gloo does without
    # a fresh key space).
    assert _attempt(port, world, "live") == ["live 0,live 1,live 2"] * world
    assert int(server.add(f"{_launch._KEYS}/generation", 0)) == 2
    old = PrefixStore(f"{_launch._KEYS}/attempt/1", server)
    assert old.get("address/1") == b"dead 1"


def _plain_group_under_restarts(rank: int, size: int, fresh: bool) -> list[str]:
    names = ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(TORCHELASTIC_MAX_RESTARTS="3", TORCHELASTIC_USE_AGENT_STORE="True")
    _launch._WARNED.clear()
    if fresh:  # as if fdp.init_distributed had made it
        _launch._FRESH.add(dist.group.WORLD)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fdp.broadcast_params({"w": torch.ones(2)})
            fdp.broadcast_params({"w": torch.ones(2)})  # warned once
    finally:
        _launch._FRESH.discard(dist.group.WORLD)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return [str(w.message) for w in caught]


def test_a_group_torchrun_cannot_restart_is_named_once() -> None:
    # dist.init_process_group under --max-restarts fails to connect after a
    # restart (before fdp runs): fdp says so at its first collective.
    for messages in ranks.world(2).run(_plain_group_under_restarts, False):
        assert len(messages) == 1
        assert messages[0].startswith(
            "fdp.broadcast_params: this job runs under torchrun --max-restarts=3, and its "
            "process group was made by torch.distributed.init_process_group"
        )
        assert "Call fdp.init_distributed() instead" in messages[0]
    assert ranks.world(2).run(_plain_group_under_restarts, True) == [[], []]
