"""Checks shared by every config dataclass: one wording for bad values, one loader for
mappings (YAML) that names an unknown key or a wrong type together with its source."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")


def check_int(owner: str, name: str, value: Any, minimum: int, *, nullable: bool = False) -> None:
    """``value`` must be an int >= ``minimum`` (or None when ``nullable``); bools are not ints."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = "None or " if nullable else ""
        raise ValueError(f"{owner}.{name}: must be {none}an int >= {minimum}, got {value!r}")


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> None:
    """``value`` must be a finite int or float (bools, NaN and inf are refused) within the
    given bounds: ``gt``/``ge`` below (exclusive/inclusive), ``lt``/``le`` above."""
    lower = ("(", ">", gt) if gt is not None else ("[", ">=", ge) if ge is not None else None
    upper = (")", "<", lt) if lt is not None else ("]", "<=", le) if le is not None else None
    if lower and upper:
        bounds = f" in {lower[0]}{lower[2]}, {upper[2]}{upper[0]}"  # e.g. " in (0, 1]"
    elif lower or upper:
        _, op, bound = lower or upper
        bounds = f" {op} {bound}"  # e.g. " > 0"
    else:
        bounds = ""
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (gt is None or value > gt)
        and (ge is None or value >= ge)
        and (lt is None or value < lt)
        and (le is None or value <= le)
    )
    if not ok:
        raise ValueError(f"{owner}.{name}: must be a finite number{bounds}, got {value!r}")


def _type_ok(value: Any, default: Any) -> bool:
    """Same type as the field's default; a None default means an optional int."""
    if default is None:
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, type(default))


def _type_name(default: Any) -> str:
    return "int or null" if default is None else type(default).__name__


def dataclass_from_dict(
    cls: type[T],
    data: Any,
    source: str,
    nested: Mapping[str, Callable[[Any, str], Any]] | None = None,
) -> T:
    """Build ``cls`` from a mapping. Unknown keys, wrong types and values the class
    rejects raise ``ValueError`` naming the key and ``source`` (a file, or a field path).
    ``nested`` maps a field to its own loader ``(value, source) -> object``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping of options, got {type(data).__name__}")
    nested = nested or {}
    known = {f.name for f in fields(cls)}
    optional = {f.name for f in fields(cls) if "None" in str(f.type)}  # annotated "X | None"
    optional_str = {f.name for f in fields(cls) if str(f.type).replace(" ", "") in ("str|None", "Optional[str]")}
    optional_bool = {f.name for f in fields(cls) if str(f.type).replace(" ", "") in ("bool|None", "Optional[bool]")}
    defaults = cls()
    values = dict(data)
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"{source}: unknown key '{key}' (known: {', '.join(sorted(known))})")
        if key in nested:
            values[key] = nested[key](value if value is not None else {}, f"{source}: {key}")
        elif value is None and key in optional:
            continue
        elif key in optional_str:
            if not isinstance(value, str):
                raise ValueError(f"{source}: key '{key}' must be str or null, got {value!r}")
        elif key in optional_bool:
            if not isinstance(value, bool):
                raise ValueError(f"{source}: key '{key}' must be true, false or null, got {value!r}")
        elif not _type_ok(value, getattr(defaults, key)):
            hint = ""
            if isinstance(getattr(defaults, key), str) and isinstance(value, bool):
                hint = " (YAML reads on/off/yes/no as booleans: quote the value, e.g. 'off')"
            raise ValueError(f"{source}: key '{key}' must be {_type_name(getattr(defaults, key))}, got {value!r}{hint}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{source}: key '{key}' must be a finite number, got {value!r}")
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _no_alias_loader():
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        """YAML without aliases (``*name``): a config never needs them, and nested aliases
        expand exponentially (a few hundred bytes can exhaust memory when the value is used)."""

        def compose_node(self, parent, index):  # noqa: D401 - PyYAML's hook
            if self.check_event(yaml.events.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in config files",
                                                  event.start_mark)
            return super().compose_node(parent, index)

    return NoAliasLoader


def load_yaml(path: str | Path, *, mapping: bool = True) -> Any:
    """A config file's YAML; every problem is one ``ValueError`` line naming the file (and, for a
    syntax error, line and column). ``mapping``: the document must be a mapping (an empty file is
    ``{}``; ``0``, ``false`` or a list are errors, never silently the defaults)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = yaml.load(text, Loader=_no_alias_loader())  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {str(exc).splitlines()[0]}") from None
    if data is None and mapping:
        return {}
    if mapping and not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of options, got {type(data).__name__} {str(data)[:40]!r}")
    return data


#: The documented default configs, shipped with the package (``configs/`` in a checkout).
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def config_path(name: str) -> Path:
    """A shipped default config by name (``"rollout"``, ``"engine"``, ``"cpu_demo"``, ...)."""
    path = CONFIG_DIR / (name if name.endswith(".yaml") else name + ".yaml")
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"config_path: no shipped config '{name}' (known: {known})")
    return path


def _type_label(tp: Any) -> str:
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return " or ".join(_type_label(a) for a in args)
    if origin in (list, tuple) or (origin is not None and getattr(origin, "__name__", "") == "Sequence"):
        return f"a list of {_type_label(args[0])}" if args else "a list"
    if origin is not None and getattr(origin, "__name__", "") in ("Mapping", "dict"):
        return f"a mapping of {_type_label(args[0])} to {_type_label(args[1])}" if len(args) == 2 else "a mapping"
    return getattr(tp, "__name__", str(tp))


def value_fits(value: Any, tp: Any) -> bool:
    """``value`` (as YAML or a command line gives it) fits the annotation ``tp``: bool, int,
    float (an int fits), str, None, ``X | Y``, ``Sequence[X]`` / ``tuple[X, ...]`` (a list or a
    tuple), ``Mapping[K, V]``. Bools are not numbers; numbers must be finite."""
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return any(value_fits(value, a) for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    name = getattr(origin, "__name__", "")
    if origin in (list, tuple) or name == "Sequence":
        if not isinstance(value, (list, tuple)):
            return False
        item = args[0] if args else Any
        return all(value_fits(v, item) for v in value)
    if name in ("Mapping", "dict"):
        if not isinstance(value, Mapping):
            return False
        k, v = args if len(args) == 2 else (Any, Any)
        return all(value_fits(a, k) and value_fits(b, v) for a, b in value.items())
    return isinstance(value, tp) if isinstance(tp, type) else True


def typed_from_dict(cls: type[T], data: Any, source: str, *, owner: str = "") -> T:
    """Build the dataclass ``cls`` (options) from a mapping, checking each value against the
    field's annotation (:func:`value_fits`). An unknown option, a wrong type, or a value the
    class rejects raises one ``ValueError`` naming the option, ``owner`` (whose options these
    are) and ``source`` (a file, or a field path)."""
    import typing

    of = f" of {owner}" if owner else ""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a mapping of the options{of}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"{source}: unknown option '{key}'{of} (its options: {', '.join(known) or 'none'})")
        if not value_fits(value, hints[key]):
            raise ValueError(f"{source}: option '{key}'{of} must be {_type_label(hints[key])}, got {value!r}")
    try:
        return cls(**data)
    except ValueError as exc:
        raise ValueError(f"{source}: {owner + ': ' if owner else ''}{exc}") from None
