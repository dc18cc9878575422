"""Every YAML under configs/ loads through the reader its folder is for: a config that no longer matches
its schema fails here, not in a user's run. A folder no reader is named for fails too."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


def _train(path: Path) -> None:
    from torchtrain.config import load_train_config

    cfg = load_train_config(path)
    assert cfg.schedule.steps >= 1 and cfg.model.name


def _data(path: Path) -> None:
    from anchor_core.data.config import load_pack_config

    assert load_pack_config(path)


def _policy(path: Path) -> None:
    from jaxref.policy import get_policy

    assert get_policy(str(path)).name


def _eval(path: Path) -> None:
    """An lm-eval task file of a local task the harness knows; tests/eval/test_harness.py parses and runs each."""
    from anchor.eval import harness

    assert path.name in {lt.yaml for lt in harness.LOCAL_TASKS.values()}


READERS = {"train": _train, "data": _data, "policies": _policy, "eval": _eval}


def test_there_are_configs_of_every_kind():
    assert {p.relative_to(ROOT / "configs").parts[0] for p in CONFIGS} == set(READERS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_config_loads(path):
    READERS[path.relative_to(ROOT / "configs").parts[0]](path)
