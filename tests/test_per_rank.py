"""``fdp.PerRank``: a part of a checkpointed state that is each rank's own.

The reference is what each rank saved: on 2 gloo ranks every rank gets its
own values back (not rank 0's), with its own structure; a torch optimizer
and a module's parameters inside load as they do outside. What cannot load
(another world size, a ``ZeroState`` inside) raises on every rank. DiLoCo's
resumed runs against the one-process simulation are in ``test_diloco.py``
and ``test_streaming_diloco.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from tests import ranks
from tests.helpers import tree_allclose


def _own(rank: int) -> dict[str, Any]:
    """Rank ``rank``'s own values: other numbers, and rank 1 a leaf more."""
    g = torch.Generator().manual_seed(rank)
    own: dict[str, Any] = {"w": torch.randn(4, 3, generator=g), "seen": 10 + rank, "none": None}
    if rank == 1:
        own["extra"] = [torch.arange(5), "text"]
    return own


def _like(rank: int) -> dict[str, Any]:
    own = {k: torch.zeros_like(v) if torch.is_tensor(v) else v for k, v in _own(rank).items()}
    return {"shared": torch.zeros(3), "mine": fdp.PerRank(own)}


def _round_trip(rank: int, size: int, path: str) -> tuple[Any, Any]:
    mine = fdp.PerRank(_own(rank))
    fdp.save_checkpoint(path, {"shared": torch.ones(3), "mine": mine})
    loaded = fdp.load_checkpoint(path, _like(rank))
    return mine.value, {"shared": loaded["shared"], "mine": loaded["mine"].value}


def test_each_rank_loads_its_own_values_and_structure(tmp_path: Path) -> None:
    got = ranks.world(2).run(_round_trip, str(tmp_path / "c"))
    for saved, loaded in got:
        tree_allclose(loaded["mine"], saved, rtol=0, atol=0)
        tree_allclose(loaded["shared"], torch.ones(3), rtol=0, atol=0)
    # The test can fail: the two ranks' own values differ.
    assert not torch.equal(got[0][0]["w"], got[1][0]["w"])
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_another_world_size_is_refused_naming_both(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    ranks.world(2).run(_round_trip, path)
    # This process is one rank of one.
    with pytest.raises(ValueError, match=r"like\['mine'\] \(fdp.PerRank\) was saved by 2 ranks; "
                       r"loading it on 1"):  # fmt: skip
        fdp.load_checkpoint(path, _like(0))
    like: dict[str, Any] = {"shared": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"entries that `like` has no leaf for: \[\"\['mine'\]"):
        fdp.load_checkpoint(path, like)
    loaded = fdp.load_checkpoint(path, like, strict=False)  # the rest, as the message says
    tree_allclose(loaded, {"shared": torch.ones(3)}, rtol=0, atol=0)


def test_per_rank_and_replicated_entries_that_do_not_match_are_named(tmp_path: Path) -> None:
    # Before: a PerRank leaf over a replicated entry was reported as an entry `like`
    # "has no leaf for", and a PerRank entry loaded as a plain leaf gave no hint.
    fdp.save_checkpoint(tmp_path / "plain", {"seen": torch.ones(2)})
    with pytest.raises(ValueError, match=r"`like` leaf like\['seen'\] expected each rank's own "
                       r"values \(it is an fdp.PerRank\); the checkpoint holds one for every "
                       r"rank there \(\['seen'\], saved without PerRank\)"):  # fmt: skip
        fdp.load_checkpoint(tmp_path / "plain", {"seen": fdp.PerRank(torch.zeros(2))})
    fdp.save_checkpoint(tmp_path / "own", {"seen": fdp.PerRank(torch.ones(2))})
    with pytest.raises(ValueError, match=r"\(\['seen'\] was saved in fdp.PerRank, each rank's "
                       r"own: put an fdp.PerRank there in `like`\)"):  # fmt: skip
        fdp.load_checkpoint(tmp_path / "own", {"seen": torch.zeros(2)})
    loaded = fdp.load_checkpoint(tmp_path / "own", {"seen": fdp.PerRank(torch.zeros(2))})
    assert torch.equal(loaded["seen"].value, torch.ones(2))


def _saved(path: str, state: Any) -> str:
    """The message save_checkpoint raised, or "saved"."""
    try:
        fdp.save_checkpoint(path, state)
    except (TypeError, ValueError) as e:
        return str(e)
    return "saved"


def _zero_inside(rank: int, size: int, path: str) -> str:
    params = {"w": torch.ones(6)}
    zero = fdp.ZeroRedundancy(fdp.optim.sgd(0.1), params)
    return _saved(path, {"opt": fdp.PerRank({"z": zero.init(params)})})


def test_a_zero_state_inside_is_refused_on_every_rank(tmp_path: Path) -> None:
    messages = ranks.world(2).run(_zero_inside, str(tmp_path / "c"))
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "fdp.save_checkpoint: `state` leaf state['opt'] (fdp.PerRank) expected a value of each "
        "rank's own; got one holding a ZeroState"
    )


def _unwrapped_diloco(rank: int, size: int, path: str) -> str:
    params = {"w": torch.ones(3)}
    diloco = fdp.DiLoCo(fdp.optim.adamw(0.1), sync_every=4)
    state = diloco.init(params)
    params, state = diloco.update({"w": torch.full((3,), rank + 1.0)}, state, params)
    return _saved(path, {"params": params, "opt": state})


def test_an_unwrapped_diloco_state_is_refused_pointing_at_per_rank(tmp_path: Path) -> None:
    messages = ranks.world(2).run(_unwrapped_diloco, str(tmp_path / "c"))
    assert messages[0] == messages[1]
    assert "`state` leaf state['opt']['inner']['exp_avg']['w']" in messages[0]
    assert (
        "(DiLoCo or LocalSGD workers' parameters and inner states): wrap them in fdp.PerRank"
        in (messages[0])
    )


def test_a_torch_optimizer_and_module_parameters_inside_load_in_one_process(
    tmp_path: Path,
) -> None:
    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        return net, torch.optim.Adam(net.parameters(), lr=0.1)

    net, opt = build()
    net(torch.ones(4, 3)).square().sum().backward()
    opt.step()
    fdp.save_checkpoint(
        tmp_path / "c", {"own": fdp.PerRank({"net": dict(net.named_parameters()), "opt": opt})}
    )
    fresh, fresh_opt = build()  # the restarted job: no moments yet
    like: dict[str, Any] = {
        "own": fdp.PerRank({"net": dict(fresh.named_parameters()), "opt": fresh_opt})
    }
    loaded = fdp.load_checkpoint(tmp_path / "c", like)
    assert loaded["own"].value["opt"] is fresh_opt
    assert loaded["own"].value["net"]["weight"] is fresh.weight  # loaded in place
    tree_allclose(dict(fresh.named_parameters()), dict(net.named_parameters()), rtol=0, atol=0)
    # The next step of each is the same: the moments came back.
    for m, o in ((net, opt), (fresh, fresh_opt)):
        o.zero_grad()
        m(torch.ones(4, 3)).square().sum().backward()
        o.step()
    tree_allclose(dict(fresh.named_parameters()), dict(net.named_parameters()), rtol=0, atol=0)
    assert repr(fdp.PerRank(1)) == "fdp.PerRank(1)"


def test_a_none_in_like_takes_the_checkpoints_tensor(tmp_path: Path) -> None:
    saved = {"slot": torch.arange(6.0).reshape(2, 3), "value": 3}
    fdp.save_checkpoint(tmp_path / "c", saved)
    like: dict[str, Any] = {"slot": None, "value": None}
    loaded = fdp.load_checkpoint(tmp_path / "c", like)
    tree_allclose(loaded, saved, rtol=0, atol=0)
    assert loaded["slot"].dtype == torch.float32
