"""The value types of the config's keys (torchtrain.config.schema): what a key accepts beyond pydantic's own strict
types, and what errors and the documentation say each accepts (`EXPECTED_BY_TYPE`)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BeforeValidator, Field, StrictInt


def _yaml_number(x: Any) -> float:
    """A finite YAML number, also `5e6` (PyYAML reads exponents without a dot as strings); never a bool."""
    if isinstance(x, bool):
        raise ValueError("a bool is not a number")
    if isinstance(x, str):
        try:
            x = float(x)
        except ValueError:
            raise ValueError("not a number") from None
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError("not a finite number")
    return float(x)


def _beta(x: Any) -> float:
    v = _yaml_number(x)
    if not 0.0 <= v < 1.0:
        raise ValueError("a beta is in [0, 1)")
    return v


Number = Annotated[float, BeforeValidator(_yaml_number)]
Name = Annotated[str, Field(strict=True, min_length=1)]
Betas = tuple[Annotated[float, BeforeValidator(_beta)], Annotated[float, BeforeValidator(_beta)]]
Steps = tuple[Annotated[StrictInt, Field(ge=1)], ...]
TRACKERS = ("tensorboard", "wandb", "mlflow")


def _tracker_names(x: Any) -> Any:
    """`logging.report_to`: a list of trackers, each once (a name given twice is one tracker); a bare name, as an
    override `logging.report_to=wandb` gives it, is a list of one."""
    if isinstance(x, str):
        return [x]
    if isinstance(x, (list, tuple)):
        return list(dict.fromkeys(x)) if all(isinstance(n, str) for n in x) else x
    return x


TrackerNames = Annotated[tuple[Literal[TRACKERS], ...], BeforeValidator(_tracker_names)]  # type: ignore[valid-type]

# What errors and the documentation say a type accepts, where the annotation alone does not tell.
ShardSize = Union[StrictInt, Name]
EXPECTED_BY_TYPE: dict[Any, str] = {
    Betas: "two numbers [beta1, beta2] in [0, 1)",
    ShardSize: 'a size as transformers writes it ("5GB", "500MB", "2GiB") or a number of bytes',
    tuple[Name, ...]: "a list of non-empty strings",
    Steps: "a list of step numbers >= 1",
    tuple[Literal[TRACKERS], ...]: f"a list among {', '.join(TRACKERS)} (or one name)",  # type: ignore[valid-type]
}


def yaml_numbers(x: Any) -> Any:
    """`x` with every string that is a number in exponent form (`1e7`, `5e-3`: PyYAML reads those without a dot
    as strings) read as the number, an integer where it is whole; mappings and lists walked."""
    if isinstance(x, dict):
        return {k: yaml_numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [yaml_numbers(v) for v in x]
    if isinstance(x, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", x.strip()):
        v = float(x)
        return int(v) if v.is_integer() and math.isfinite(v) else v
    return x
