"""Which extra of `anchor-toolkit` installs a module a feature reaches, and the one line that says so.

The base install serves a Trainer/TRL user (the collator, the attention functions, the typed config); the
oracle, `anchor train`'s DeepSpeed and data readers, evaluation and TRL come with extras (pyproject.toml). A
command that imports a module of a missing extra fails with `missing_extra`'s line, naming the pip command; an
entry point that needs an extra checks it first (`require`, `missing_line`), so that nothing is done before.
"""

from __future__ import annotations

import importlib.util

DISTRIBUTION = "anchor-toolkit"

# top-level module -> the extra that installs it
EXTRAS: dict[str, str] = {
    "jax": "oracle", "jaxlib": "oracle", "flax": "oracle", "optax": "oracle", "orbax": "oracle",
    "deepspeed": "train", "accelerate": "train", "datasets": "train", "pyarrow": "train", "gguf": "train",
    "matplotlib": "train", "tensorboard": "train",
    "wandb": "trackers", "mlflow": "trackers", "sqlalchemy": "trackers", "alembic": "trackers",
    "lm_eval": "eval",
    "trl": "hf",
}


def extra_of(error: BaseException) -> str | None:
    """The extra whose module `error` (a ModuleNotFoundError) names as missing, or None."""
    name = getattr(error, "name", None)
    if not isinstance(error, ModuleNotFoundError) or not name:
        return None
    return EXTRAS.get(name.split(".")[0])


def missing_extra(error: BaseException, feature: str) -> str | None:
    """'FEATURE needs the EXTRA extra (MODULE is not installed): pip install "anchor-toolkit[EXTRA]"', or
    None where the missing module is no extra's."""
    extra = extra_of(error)
    if extra is None:
        return None
    module = str(getattr(error, "name", "")).split(".")[0]
    return (f"{feature} needs the {extra} extra ({module} is not installed): "
            f'pip install "{DISTRIBUTION}[{extra}]"')


def modules_of(extra: str) -> list[str]:
    """The top-level modules `extra` installs that EXTRAS lists under it."""
    return [module for module, owner in EXTRAS.items() if owner == extra]


def missing_module(extra: str, *modules: str) -> str | None:
    """The first of `modules` (default: every module of `extra`) not installed here, or None. Looked up, not
    imported: importing DeepSpeed or JAX takes seconds, and a check made before any work must not cost that."""
    unknown = [m for m in modules if EXTRAS.get(m) != extra]
    if unknown:
        raise ValueError(f"{unknown[0]} is not a module of the {extra} extra (EXTRAS)")
    for module in modules or modules_of(extra):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ValueError:  # in sys.modules without a spec: loaded, so present
            continue
    return None


def require(extra: str, *modules: str) -> None:
    """Raise ModuleNotFoundError (named after the missing module) where one of `modules` of `extra` (default: all)
    is not installed: called at an entry point's start, with the modules it always imports, before it reads or
    writes anything; the command line turns it into `missing_extra`'s line (exit 2)."""
    module = missing_module(extra, *modules)
    if module is not None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def missing_line(extra: str, feature: str, *modules: str) -> str | None:
    """`missing_extra`'s line where one of `modules` of `extra` (default: all) is not installed here, else None
    (for an entry point that is not a command: the pytest plugin's fixtures)."""
    try:
        require(extra, *modules)
    except ModuleNotFoundError as e:
        return missing_extra(e, feature)
    return None
