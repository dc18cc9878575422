"""Which extra of `anchor-toolkit` installs a module a feature reaches, and the one line that says so.

The base install serves a Trainer/TRL user (the collator, the attention functions, the typed config); the
oracle, `anchor train`'s DeepSpeed and data readers, evaluation and TRL come with extras (pyproject.toml). A
command that imports a module of a missing extra fails with `missing_extra`'s line, naming the pip command.
"""

from __future__ import annotations

DISTRIBUTION = "anchor-toolkit"

# top-level module -> the extra that installs it
EXTRAS: dict[str, str] = {
    "jax": "oracle", "jaxlib": "oracle", "flax": "oracle", "optax": "oracle", "orbax": "oracle",
    "deepspeed": "train", "accelerate": "train", "datasets": "train", "pyarrow": "train", "gguf": "train",
    "matplotlib": "train",
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
