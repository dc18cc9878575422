"""The one reader of the project's YAML files: train configs, data configs, dtype policies.

    d = read_yaml_mapping("configs/train/tiny.yaml", what="train config")
    d, lines = read_yaml_mapping_lines("configs/train/tiny.yaml", what="train config")   # lines["optim.lr"] == 23

    value = parse_yaml("[0.9, 0.95]", where="command-line override optim.betas=[0.9, 0.95]")

Every failure is an InputError whose one-line message names the file and the problem (the CLI
prints it and exits 2): the file cannot be read, is not UTF-8 text, is not valid YAML (with the
line and column of the problem), gives a key twice in one mapping (YAML requires keys to be unique;
PyYAML alone would keep the last silently), or does not hold a mapping.

What is read is bounded before anything is built from it: the file at most `MAX_BYTES`, and the document
as its aliases expand it (`*name` repeats the node `&name` marks, which PyYAML shares rather than copies,
but whatever walks the data, a validator or an error message, walks every repeat: nine levels of nine
aliases are 9**9 values from a few hundred bytes) at most `MAX_NODES` values, `MAX_BYTES` of scalar text
and `MAX_DEPTH` levels, and no alias inside itself.

Booleans are YAML 1.2's: `true` and `false` (`True`, `TRUE`, ...). YAML 1.1's `yes`, `no`, `on`, `off`
are plain strings, which a boolean key refuses as it refuses `1`; PyYAML alone reads them as booleans.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from anchor_core.errors import InputError

MAX_BYTES = 1 << 20  # of a file, and of the scalars of its document as the aliases expand it
MAX_NODES = 10_000  # values (scalars, lists, mappings) of the document as the aliases expand it
MAX_DEPTH = 64  # levels of lists and mappings one inside the other

_BOOL = "tag:yaml.org,2002:bool"
_YAML12_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


def read_yaml(path: str | Path, *, what: str = "YAML file") -> Any:
    """The data of the YAML file `path` (None for an empty file). `what` names the file's kind in
    the cannot-read message ("train config", "policy file")."""
    return read_yaml_lines(path, what=what)[0]


def read_yaml_lines(path: str | Path, *, what: str = "YAML file") -> tuple[Any, dict[str, int]]:
    """The data of the YAML file `path`, and the line (from 1) of each key of its mappings by dotted path
    (`optim.lr`; a mapping inside a list: `items[0].name`): where errors about a key's value point."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # no more than that of a file of any size
    except OSError as e:
        raise InputError(f"cannot read {what}: {e.strerror or e}", path=path) from None
    if len(data) > MAX_BYTES:
        raise InputError(f"larger than a {what} can be (more than {MAX_BYTES} bytes)", path=path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (invalid byte at offset {e.start})", path=path) from None
    lines: dict[str, int] = {}
    return _document(text, path, lines=lines), lines


def parse_yaml(text: str, *, where: str, text_if_invalid: bool = False) -> Any:
    """The data of the YAML `text` (None where it holds nothing), read and bounded as a file is; `where` (a
    command-line override) is named in errors. `text_if_invalid`: text that is not valid YAML is the string
    itself (a command-line value), not an error."""
    if len(text) > MAX_BYTES:
        raise InputError(f"larger than a value can be (more than {MAX_BYTES} characters)", path=where)
    return _document(text, where, text_if_invalid=text_if_invalid)


def _document(text: str, where: object, *, lines: dict[str, int] | None = None,
              text_if_invalid: bool = False) -> Any:
    """The one document of `text`, bounded (`_check_size`) before it is built, every failure an InputError naming
    `where`; with `lines`, each key's line filled in (`_key_lines`); with `text_if_invalid`, invalid YAML is the
    text itself."""
    import yaml

    loader = _loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node, where, loader.aliased)
        if lines is not None:
            _key_lines(node, "", loader, lines, set(), where)
        return loader.construct_document(node)
    except (yaml.YAMLError, RecursionError) as e:  # PyYAML composes nested lists and mappings by recursion
        if text_if_invalid:
            return text
        if isinstance(e, RecursionError):
            raise InputError(f"invalid YAML: lists and mappings nested more than {MAX_DEPTH} deep",
                             path=where) from None
        raise InputError(f"invalid YAML{_problem(e)}", path=where) from None
    finally:
        loader.dispose()


def _loader(text: str) -> Any:
    """PyYAML's safe loader over `text`, with YAML 1.2's booleans (module docstring)."""
    return _loader_class()(text)


@functools.cache
def _loader_class() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        aliased = False  # the document repeats a node by an alias (said in the size errors)

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                self.aliased = True
            return super().compose_node(parent, index)

    def construct_int(loader: Any, node: Any) -> int:
        """PyYAML's integer, and a YAML error (not Python's ValueError) for one longer than Python reads."""
        try:
            return yaml.SafeLoader.construct_yaml_int(loader, node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} characters, more than Python reads (4300 digits)",
                node.start_mark) from None

    # the resolvers by first character, without YAML 1.1's booleans; then YAML 1.2's
    Loader.yaml_implicit_resolvers = {c: [(tag, rx) for tag, rx in rs if tag != _BOOL]
                                      for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(_BOOL, _YAML12_BOOL, list("tTfF"))
    Loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    return Loader


def _check_size(root: Any, where: object, aliased: bool) -> None:
    """InputError naming `where` when the document under `root`, with every alias expanded, holds more than
    MAX_NODES values, more than MAX_BYTES of scalar text or lists and mappings more than MAX_DEPTH deep, or
    an alias inside the node it names (a recursive document): counted over the node graph with each node's
    size computed once, so a document of a billion values costs no more than its text."""
    import yaml

    sizes: dict[int, tuple[int, int, int]] = {}  # id(node) -> (values, scalar bytes, depth) of its expansion
    open_: set[int] = set()  # the nodes entered and not yet counted: those the walk is inside
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = (1, len(node.value), 0)
            continue
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        if not children_done:  # entered: its children are counted first
            if any(id(c) in open_ for c in children):  # an alias of a node it lies inside
                raise InputError("a YAML alias (*name) inside the node it names: a document without end",
                                 path=where)
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        open_.discard(id(node))
        values, nbytes, depth = 1, 0, 0
        for c in children:
            v, b, d = sizes[id(c)]
            values, nbytes, depth = values + v, nbytes + b, max(depth, d)
        sizes[id(node)] = (values, nbytes, depth + 1)
        if values > MAX_NODES or nbytes > MAX_BYTES or depth + 1 > MAX_DEPTH:
            what = (f"more than {MAX_NODES} values" if values > MAX_NODES else
                    f"more than {MAX_BYTES} bytes of text" if nbytes > MAX_BYTES else
                    f"lists and mappings nested more than {MAX_DEPTH} deep")
            raise InputError(f"the document holds {what}" + (" once its YAML aliases (*name) are expanded"
                                                               if aliased else ""), path=where)


def read_yaml_mapping(path: str | Path, *, what: str = "YAML file", empty_ok: bool = True) -> dict[str, Any]:
    """The mapping the YAML file `path` holds; an empty file is `{}` when `empty_ok`, else an error
    like any other non-mapping."""
    return read_yaml_mapping_lines(path, what=what, empty_ok=empty_ok)[0]


def read_yaml_mapping_lines(path: str | Path, *, what: str = "YAML file",
                            empty_ok: bool = True) -> tuple[dict[str, Any], dict[str, int]]:
    """`read_yaml_mapping`, and the line of each key (`read_yaml_lines`)."""
    data, lines = read_yaml_lines(path, what=what)
    if data is None and empty_ok:
        return {}, {}
    if not isinstance(data, dict):
        got = "an empty file" if data is None else type(data).__name__
        raise InputError(f"a {what} must be a mapping of keys to values, got {got}", path=path)
    return data, lines


def _key_lines(node: Any, prefix: str, loader: Any, lines: dict[str, int], seen: set[int], path: Path) -> None:
    """Record the line of every mapping key under `node` (dotted below `prefix`); a key given twice in one
    mapping is an InputError naming it, both values and their lines. Merge keys (`<<: *base`) are YAML's own
    way to override, not repeats."""
    import yaml

    if id(node) in seen:  # an alias of a node already walked (a recursive structure stops here)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _key_lines(item, f"{prefix}[{i}]", loader, lines, seen, path)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    given: dict[Any, tuple[Any, Any]] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            first = given.get(key)
        except TypeError:  # an unhashable key: PyYAML's constructor names it
            continue
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if first is not None:
            (k1, v1), (k2, v2) = first, (key_node, value_node)
            raise InputError(f"{dotted} is given twice: {_shown(v1)} (line {k1.start_mark.line + 1}) and "
                             f"{_shown(v2)} (line {k2.start_mark.line + 1}); give each key once", path=path)
        given[key] = (key_node, value_node)
        lines[dotted] = key_node.start_mark.line + 1
        _key_lines(value_node, dotted, loader, lines, seen, path)


def _shown(node: Any) -> str:
    """A value as its YAML text (a scalar, shortened) or its kind (a mapping, a list)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    text = " ".join(str(node.value)[:200].split()) or "null"
    return text if len(text) <= 40 else text[:37] + "..."


def _problem(e: Exception) -> str:
    """` at line L, column C: problem (context)` of a PyYAML error, or `: its text` on one line."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return f": {' '.join(str(e).split())}"
    context = getattr(e, "context", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
