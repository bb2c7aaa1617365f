"""fdp.latest_checkpoint: the newest complete checkpoint, rank 0's pick on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fdp
from tests import ranks


def _layout(root: Path, complete: list[str], partial: list[str]) -> None:
    for name in complete:
        (root / name).mkdir(parents=True)
        (root / name / ".metadata").write_bytes(b"")
    for name in partial:
        (root / name).mkdir(parents=True)  # a save killed midway: no .metadata
    (root / "notes").mkdir(exist_ok=True)
    (root / "step_99").write_text("a file, not a checkpoint")


def test_the_newest_complete_checkpoint_by_its_number(tmp_path: Path) -> None:
    assert fdp.latest_checkpoint(tmp_path / "missing") is None
    _layout(tmp_path, ["step_2", "step_10", "ckpt-7"], ["step_11"])
    # By number, not by name: step_10 is newer than step_2; step_11 is incomplete.
    assert fdp.latest_checkpoint(tmp_path) == str(tmp_path / "step_10")
    assert fdp.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_10")


def test_a_real_save_is_found_and_loads(tmp_path: Path) -> None:
    state: dict[str, Any] = {"w": torch.arange(3.0), "step": 4}
    fdp.save_checkpoint(tmp_path / "step_4", state)
    found = fdp.latest_checkpoint(tmp_path)
    assert found == str(tmp_path / "step_4")
    like: dict[str, Any] = {"w": torch.zeros(3), "step": 0}
    loaded = fdp.load_checkpoint(found, like)
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"] == 4


def test_a_path_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"`directory` expected a path \(str or os.PathLike\)"):
        fdp.latest_checkpoint(3)  # type: ignore[arg-type]


def _per_rank(rank: int, size: int, root: str) -> Any:
    # Each rank sees its own folder (not shared between hosts): rank 1's is newer.
    mine = Path(root) / f"rank{rank}"
    _layout(mine, [f"step_{5 * (rank + 1)}"], [])
    found = fdp.latest_checkpoint(mine)
    return None if found is None else Path(found).relative_to(root).as_posix()


def test_every_rank_takes_rank_0s_pick(tmp_path: Path) -> None:
    assert ranks.world(2).run(_per_rank, str(tmp_path)) == ["rank0/step_5", "rank0/step_5"]
