"""Where each key of a config came from: a command-line override, a file and the key's line in it, or nowhere (a
default). Errors name it (`TrainConfig.where`): `command-line override optim.lr=abc`, `tiny.yaml:23`.
"""

from __future__ import annotations

from typing import Mapping, Sequence


class Sources:
    """Where each key of a config came from: the command-line overrides (dotted key -> `command-line override
    optim.lr=abc`, for every key an override sets), else the file and the key's line in it, else nowhere (a
    default). `file` alone is named where none of the keys an error is about was given."""

    def __init__(self, file: str, lines: Mapping[str, int] | None = None,
                 overrides: Mapping[str, str] | None = None):
        self.file = str(file)
        self.lines = dict(lines or {})
        self.overrides = dict(overrides or {})

    def places(self, dotted: str) -> list[str]:
        """Where `dotted` came from: the override that set it (or a value above it), else its line in the file;
        and the overrides that set keys below it (`model.rope` from `model.rope.scaling=yarn`)."""
        parts = dotted.split(".")
        above = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        out = [next((self.overrides[k] for k in above if k in self.overrides), None)]
        if out[0] is None and dotted in self.lines:
            out[0] = f"{self.file}:{self.lines[dotted]}"
        out += [o for k, o in self.overrides.items() if k.startswith(dotted + ".")]
        return list(dict.fromkeys(o for o in out if o is not None))

    def where(self, *keys: str) -> str:
        """The places of `keys` as the `path` of an InputError, joined with "and" where they are several (then a
        line of the file names its key); the file where none of them was given."""
        places: dict[str, str] = {}  # place -> the key it gave
        for key in keys:
            for place in self.places(key):
                places.setdefault(place, key)
        if len(places) <= 1:
            return next(iter(places), self.file)
        return " and ".join(f"{p} ({k})" if p.startswith(f"{self.file}:") else p for p, k in places.items())

    def without(self, keys: Sequence[str]) -> "Sources":
        """These sources with `keys` (and what lies below them) given by no one: changed by the program."""
        def kept(k: str) -> bool:
            return not any(k == c or k.startswith(c + ".") for c in keys)

        return Sources(self.file, {k: v for k, v in self.lines.items() if kept(k)},
                       {k: v for k, v in self.overrides.items() if kept(k)})
