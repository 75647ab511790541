"""Machinery behind ``torchacc.config``: field type checks, the OmegaConf schema, merging and plain-data conversion.

Nothing here imports ``torchacc.config``; the functions that need the tree take its root class as an argument.
"""

import dataclasses
import difflib
import functools
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, ClassVar, Union

# What to write instead, per expected type; the "how to fix" part of every type error.
_EXAMPLES = {
    bool: "True or False",
    int: "an integer such as 2",
    float: "a number such as 1800.0",
    set: "a set of class names such as {'GPT2Block'} (in YAML or on the command line: [GPT2Block])",
    list: "a list of str such as ['dp', 'fsdp']",
    dict: "a mapping of str to str such as {'layers.*.mlp.up_proj': 'colwise'}",
}


class Node:
    """Base of every config node: type-checks (and normalizes) the fields on construction."""

    __slots__ = ()
    _path: ClassVar[str] = ""  # dotted path of this node in the Config tree, for error messages

    def __post_init__(self) -> None:
        self._check_types()

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            object.__setattr__(self, name, value)
        except AttributeError:
            raise AttributeError(_unknown_field(type(self), name)) from None

    def _check_types(self, recursive: bool = False) -> None:
        for name, tp in field_types(type(self)):
            value = _check_type(getattr(self, name), tp, f"{self._path}.{name}".lstrip("."))
            setattr(self, name, value)
            if recursive and isinstance(value, Node):
                value._check_types(recursive=True)


@functools.cache
def field_types(cls: Any) -> list[tuple[str, Any]]:
    """Return ``[(field name, resolved annotation)]`` of a dataclass, in field order."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def fmt(value: Any) -> str:
    """Return ``repr(value)``, with sets sorted so that every rank prints the same message."""
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(repr, value))) + "}" if value else "set()"
    return repr(value)


def to_plain(value: Any) -> Any:
    """Return ``value`` as plain YAML-able data: dataclasses to dicts, sets to sorted lists, tuples to lists."""
    if isinstance(value, Node):
        return {name: to_plain(getattr(value, name)) for name, _ in field_types(type(value))}
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return [to_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def to_yaml(node: Node) -> str:
    """Return ``node`` as YAML text."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(to_plain(node))


def from_yaml(cls: type, path: str | os.PathLike[str]) -> Any:
    """Build ``cls`` from a YAML file; a ValueError gets the file name appended."""
    data = load_yaml(path)
    try:
        return merge(cls, [data])
    except ValueError as e:
        raise ValueError(f"{e} (in {os.fspath(path)})") from None


def load_yaml(path: str | os.PathLike[str]) -> Any:
    """A config file's mapping; a file holding anything else (a scalar, a list) is a ValueError."""
    import yaml
    from omegaconf import OmegaConf

    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"config: not valid YAML ({' '.join(str(e).split())}) (in {os.fspath(path)})") from None
    if data is not None and not isinstance(data, Mapping):
        raise ValueError(
            f"config: the file holds {fmt(data)} ({type(data).__name__}), not a mapping of sections; write e.g. "
            f"'dist: {{fsdp: {{size: 2}}}}' (Config().to_yaml() shows every section) (in {os.fspath(path)})"
        )
    return OmegaConf.create(data or {})


def from_cli(cls: type, argv: Sequence[str] | None, base: Any) -> Any:
    """Build ``cls`` from ``KEY=VALUE`` arguments layered as ``base``, ``config=`` files, then dotted overrides."""
    import yaml
    from omegaconf import OmegaConf

    files: list[Any] = [] if base is None else [base.to_dict()]  # then the files, then the overrides
    overrides = []
    for arg in sys.argv[1:] if argv is None else argv:
        key, sep, value = arg.partition("=")
        if not sep or "" in key.split("."):
            raise ValueError(f"{arg!r}: expected KEY=VALUE such as dist.fsdp.size=2, or config=PATH.yaml")
        if key == "config":
            files.append(load_yaml(value))
        else:
            overrides.append(arg)
    for arg in overrides:
        try:
            files.append(OmegaConf.from_dotlist([arg]))
        except yaml.YAMLError as e:
            raise ValueError(f"{arg!r}: the value is not valid YAML ({' '.join(str(e).split())})") from None
    return merge(cls, files)


def merge(cls: type, sources: list[Any]) -> Any:
    """Merge user mappings (later wins) into the typed OmegaConf schema of ``cls`` and build the dataclasses."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    for src in sources:
        _require_sections(src, cls, "")
    user = OmegaConf.merge({}, *[s if isinstance(s, DictConfig) else OmegaConf.create(to_plain(s)) for s in sources])
    try:
        data = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(_schema(cls)), user), resolve=True)
    except ConfigKeyError as e:
        parent, _, key = e.full_key.rpartition(".")
        node = _type_at(cls, parent)
        valid = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"; did you mean {f'{parent}.' if parent else ''}{close[0]}?" if close else ""
        where = f"under {parent}" if parent else "at the top level"
        raise ValueError(f"{e.full_key}: unknown key; valid keys {where}: {', '.join(valid)}{hint}") from None
    except OmegaConfBaseException as e:
        key = (e.full_key or "").split("[")[0]
        if not key or not isinstance(e, ValidationError) or _type_at(cls, key) is None:
            raise ValueError(f"{key or 'config'}: {str(e).splitlines()[0]}") from None
        value = OmegaConf.select(user, key, throw_on_resolution_failure=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        raise _type_error(key, _type_at(cls, key), value) from None
    return _build(cls, data)


def _unknown_field(cls: Any, name: str) -> str:
    """The message for setting a field that ``cls`` does not have: the valid ones and the closest match."""
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, valid, n=1)
    where = cls._path or "the top level"
    hint = f"; did you mean {f'{cls._path}.' if cls._path else ''}{close[0]}?" if close else ""
    return f"{f'{cls._path}.' if cls._path else ''}{name}: unknown key; valid keys at {where}: {', '.join(valid)}{hint}"


def _alternatives(tp: Any) -> tuple[list[Any], bool]:
    """The non-None members of a union annotation (or ``[tp]``), and whether None is allowed."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = typing.get_args(tp)
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is dict:
        return "dict of str to str"
    return f"{origin.__name__} of str" if origin else tp.__name__


def _type_error(path: str, tp: Any, value: Any) -> ValueError:
    alternatives, optional = _alternatives(tp)
    names = [_type_name(a) for a in alternatives] + (["None"] if optional else [])
    uses = [_EXAMPLES.get(typing.get_origin(a) or a, f"a {_type_name(a)} instance") for a in alternatives]
    uses += ["None"] if optional else []
    return ValueError(
        f"{path}: expected {' or '.join(names)}, got {fmt(value)} ({type(value).__name__}); use {' or '.join(uses)}"
    )


def _check_one(value: Any, tp: Any) -> tuple[bool, Any]:
    """(True, normalized value) if ``value`` fits the single type ``tp``, else (False, None)."""
    origin = typing.get_origin(tp)
    if origin is set and isinstance(value, (set, frozenset, list, tuple)) and all(isinstance(v, str) for v in value):
        return True, set(value)
    if origin is list and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return True, list(value)
    if origin is dict and isinstance(value, Mapping) and all(isinstance(v, str) for v in (*value, *value.values())):
        return True, dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, float(value)
    if origin is None and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return True, value
    return False, None


def _check_type(value: Any, tp: Any, path: str) -> Any:
    """Return ``value`` normalized to ``tp`` (list/tuple -> set, int -> float), or raise ValueError."""
    alternatives, optional = _alternatives(tp)
    if value is None and optional:
        return None
    for alternative in alternatives:
        ok, normalized = _check_one(value, alternative)
        if ok:
            return normalized
    raise _type_error(path, tp, value)


@functools.cache
def _schema(cls: type) -> type:
    """Derive the OmegaConf structured-config dataclass of ``cls``: OmegaConf has no set type, so set -> list."""
    default, specs = cls(), []
    for name, tp in field_types(cls):
        value = getattr(default, name)
        if dataclasses.is_dataclass(tp):
            specs.append((name, _schema(tp), field(default_factory=_schema(tp))))
        elif typing.get_origin(tp) in (set, list):
            specs.append((name, list[str], field(default_factory=functools.partial(list, to_plain(value)))))
        elif any(typing.get_origin(a) is dict for a in _alternatives(tp)[0]):
            specs.append((name, Any, field(default=value)))  # OmegaConf has no str-or-mapping union
        else:
            specs.append((name, tp, field(default=value)))
    return dataclasses.make_dataclass(cls.__name__, specs, kw_only=True)


def _type_at(root: type, path: str) -> Any:
    """Return the annotation at a dotted path under ``root`` ("" is ``root`` itself), or None if it leaves the tree."""
    tp: Any = root
    for part in path.split(".") if path else []:
        tp = dict(field_types(tp)).get(part) if dataclasses.is_dataclass(tp) else None
    return tp


def _require_sections(src: Any, cls: type, path: str) -> None:
    """Raise unless ``src`` has a mapping wherever ``cls`` has a section; OmegaConf reports those without a key."""
    if not isinstance(src, Mapping):
        keys = ", ".join(name for name, _ in field_types(cls))
        raise ValueError(f"{path or 'config'}: expected a mapping with keys {keys}, got {fmt(src)}")
    for key, value in src.items():
        tp = dict(field_types(cls)).get(key)
        if dataclasses.is_dataclass(tp):
            _require_sections(value, tp, f"{path}.{key}".lstrip("."))
        elif typing.get_origin(tp) in (set, list) and isinstance(value, Mapping):
            # YAML reads {GPT2Block} (a Python set literal) as the mapping {GPT2Block: null}
            names = ", ".join(map(str, value))
            raise ValueError(
                f"{path}.{key}".lstrip(".") + f": got {{{names}}}, which YAML reads as a mapping, not a set; "
                f"write a YAML list: [{names}] (on the command line: {f'{path}.{key}'.lstrip('.')}=[{names}])"
            )


def _build(cls: type, data: Mapping[str, Any]) -> Any:
    """Instantiate the real dataclasses from merged plain data (lists -> sets for set fields)."""
    kwargs = {}
    for name, tp in field_types(cls):
        value = data[name]
        kwargs[name] = _build(tp, value) if dataclasses.is_dataclass(tp) else value
    return cls(**kwargs)
