"""What a config field says about itself, and the walk over a config class's fields.

A field of the config dataclasses (runtime/config.py) is declared once, with `arg(default, help,
...)`: its name, type and default are the dataclass's, and its metadata adds what a command line
or a config file needs besides — help text, choices, a flag name where the field's own would not
do, the environment variable that stands in for an unset value, and whether it is a secret (never
written to a file). `settings(cls)` flattens a config, nested configs included, into `Setting`s;
`build(cls, value_of)` makes a config from one value per setting. runtime/cli_args.py and
runtime/config_file.py are both written over these two, so neither knows any particular field.

A field's type is a scalar (bool, int, float, str), a `StrEnum` (its members are the choices, and
it is spelled as their values on a command line and in a file), or a nested config class. A nested
config given a default instance (`field(default_factory=lambda: LIMITS)`) lends its leaves that
instance's values as defaults, so one class declared once can serve a command whose defaults differ
(`bench plan`'s unbounded pools) without a second declaration.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator

_KEY = "splitserve"
SCALARS = (bool, int, float, str)
TRI_STATE = {"auto": None, "on": True, "off": False}     # how `bool | None` is spelled on a command line


class ConfigError(ValueError):
    """A config value or file that does not fit the config classes (names the field)."""


@dataclass(frozen=True, slots=True)
class Meta:
    help: str
    choices: tuple[str, ...] | None = None
    flag: str | None = None          # default: --field-name (bools that default to True: --no-field-name)
    env: str | None = None           # read when the value is set neither by flag nor by file
    secret: bool = False             # never in a config file or argv: flag or environment only
    cli_default: Any = None          # a default for the command line only, for fields the class requires
    const: Any = None                # the value of the flag given without one (`--ray` alone); none: it needs one


def arg(default: Any, help: str, *, choices: tuple[str, ...] | None = None, flag: str | None = None,
        env: str | None = None, secret: bool = False, cli_default: Any = None, const: Any = None) -> Any:
    """A dataclass field with its command-line and file metadata. `default=MISSING`: required."""
    meta = {_KEY: Meta(help, choices, flag, env, secret, cli_default, const)}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Setting:
    """One leaf of a (possibly nested) config class."""
    path: str                        # dotted, from the root class: "engine.block_size"
    owner: type                      # the dataclass that declares it
    type: type                       # bool | int | float | str
    optional: bool                   # `X | None`
    default: Any                     # MISSING: required
    meta: Meta

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The values the setting may take, as spelled on a command line and in a file."""
        if isinstance(self.type, enum.EnumMeta):
            return tuple(m.value for m in self.type)
        return self.meta.choices

    @property
    def tri_state(self) -> bool:
        return self.type is bool and self.optional

    @property
    def flag(self) -> str:
        if self.meta.flag:
            return self.meta.flag
        negated = self.type is bool and not self.optional and self.default is True
        return ("--no-" if negated else "--") + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """`value` as this setting holds it (an int is a valid float), or ConfigError."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{self.path}: must be set (a {self.type.__name__}), got null")
        if isinstance(self.type, enum.EnumMeta):
            return self._member(value)
        ok = isinstance(value, self.type) and not (self.type is int and isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"{self.path}: expected {self.type.__name__}"
                              f"{' or null' if self.optional else ''}, got {type(value).__name__} {value!r}")
        if self.meta.choices and value not in self.meta.choices:
            raise ConfigError(f"{self.path}: {value!r} is not one of {', '.join(self.meta.choices)}")
        return value

    def _member(self, value: Any) -> enum.Enum:
        if not isinstance(value, str):
            raise ConfigError(f"{self.path}: expected str, got {type(value).__name__} {value!r}")
        try:
            return self.type(value)
        except ValueError:
            raise ConfigError(f"{self.path}: {value!r} is not one of {', '.join(self.choices)}") from None


def _leaf_type(cls: type, name: str, hint: Any) -> tuple[type, bool]:
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        assert len(args) == 1, f"{cls.__name__}.{name}: only `X | None` unions are supported"
        hint = args[0]
    is_enum = isinstance(hint, type) and issubclass(hint, enum.StrEnum)
    ok = hint in SCALARS or dataclasses.is_dataclass(hint) or is_enum
    assert ok, f"{cls.__name__}.{name}: unsupported type {hint}"
    return hint, optional


@functools.cache
def children(cls: type, prefix: str = "") -> tuple[tuple[str, type | None, Setting | None], ...]:
    """(field name, nested config class, None) or (field name, None, leaf setting), per field."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        t, optional = _leaf_type(cls, f.name, hints[f.name])
        if dataclasses.is_dataclass(t):
            out.append((f.name, t, None))
            continue
        assert _KEY in f.metadata, f"{cls.__name__}.{f.name} needs arg(...) metadata (help text)"
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out.append((f.name, None, Setting(prefix + f.name, cls, t, optional, default, f.metadata[_KEY])))
    return tuple(out)


def _nested_default(cls: type, name: str, base: Any) -> Any:
    """The instance whose values a nested config's leaves take as defaults: the enclosing default
    instance's, else the field's own default (None: the nested class's field defaults)."""
    if base is not None:
        return getattr(base, name)
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default_factory is not MISSING else None


def settings(cls: type, prefix: str = "", base: Any = None) -> Iterator[Setting]:
    """Every leaf field of config class `cls`, nested configs flattened, in declaration order;
    `base`: an instance whose values are the defaults."""
    for name, nested, s in children(cls, prefix):
        if nested is not None:
            yield from settings(nested, f"{prefix}{name}.", _nested_default(cls, name, base))
        else:
            yield s if base is None else dataclasses.replace(s, default=getattr(base, name))


def build(cls: type, value_of: Callable[[Setting], Any], prefix: str = "", base: Any = None) -> Any:
    """A `cls` whose leaves are `value_of(setting)`; a leaf whose value is MISSING takes its default
    (`base`'s value if given; ConfigError where the class requires it)."""
    kwargs = {}
    for name, nested, s in children(cls, prefix):
        if nested is not None:
            kwargs[name] = build(nested, value_of, f"{prefix}{name}.", _nested_default(cls, name, base))
            continue
        value = value_of(s)
        if value is MISSING and base is not None:
            value = getattr(base, name)
        if value is not MISSING:
            kwargs[name] = value
        elif s.default is MISSING:
            raise ConfigError(f"{s.path} is required: {s.meta.help}")
    return cls(**kwargs)
