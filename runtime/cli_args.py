"""Command-line flags generated from the config dataclasses, and configs built back from them.

`add_config_args(parser, cls)` adds one flag per leaf field of `cls` (nested configs flattened, one
help group per class) plus `--config FILE`; `config_from_args(cls, namespace)` builds the config.
A field's flag follows from its type:

    int / float / str      --block-size N           (`X | None`: unset means none)
    choices, StrEnum       --device {auto,cpu,cuda}
    bool, default False    --mock                   (a switch)
    bool, default True     --no-cuda-graphs         (a switch that turns it off)
    bool | None            --async-scheduling {auto,on,off}
    const                  --ray [ADDRESS]          (given alone: the field's const)

unless the field names its flag (`--redis-url`, `--no-prefix-caching`). A command may add old
spellings of a flag (`aliases`) and make a flag required there (`required`). Each value comes from,
in order: the flag, the `--config` file, the field's environment variable, the field's default.
Secrets (the API key) come from the flag or the environment only. Knows no particular field.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import MISSING
from typing import Any

from runtime.config_fields import TRI_STATE, Setting, build, settings
from runtime.config_file import read_config

CONFIG_DEST = "config"


def _shown(s: Setting) -> str:
    default = s.default if s.meta.cli_default is None else s.meta.cli_default
    if s.tri_state:
        text = {v: k for k, v in TRI_STATE.items()}[default]
    elif s.type is bool:
        text = "on" if default else "off"
    else:
        text = "none" if default is None else str(default)
    return f"${s.meta.env}, else {text}" if s.meta.env else text


def _add(group: argparse._ArgumentGroup, s: Setting, prefix: str, aliases: Sequence[str] = (),
         required: bool = False) -> None:
    negated = s.type is bool and s.default is True and not s.optional
    text = f"turn off: {s.meta.help}" if negated else s.meta.help
    shown = "required" if required else f"default: {_shown(s)}"
    kw: dict[str, Any] = dict(dest=prefix + s.path, default=argparse.SUPPRESS, help=f"{text} ({shown})")
    if s.tri_state:
        kw.update(choices=tuple(TRI_STATE), metavar="auto|on|off")
    elif s.type is bool:
        kw.update(action="store_const", const=not s.default)
    else:
        choices = s.choices
        kw.update(type=str if choices else s.type, choices=choices, metavar=None if choices else s.name.upper())
        if s.meta.const is not None:          # `--ray` alone means `--ray local`
            kw.update(nargs="?", const=s.meta.const)
    if required:
        kw.update(required=True)
    group.add_argument(s.flag, *aliases, **kw)


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: Collection[str] = (),
                    only: Collection[str] | None = None, config_file: bool = True, prefix: str = "",
                    aliases: Mapping[str, Sequence[str]] | None = None, required: Collection[str] = ()) -> None:
    """One flag per leaf field of `cls` (or of the dotted paths in `only`) except those in `skip`,
    and `--config FILE`. Values land in the namespace under `prefix` + the field's dotted path.
    `aliases`: more spellings of a field's flag on this command, by dotted path (a renamed flag's
    old name); `required`: dotted paths this command must be given."""
    if config_file:
        parser.add_argument("--config", dest=CONFIG_DEST, metavar="FILE", default=None,
                            help=f"JSON of a {cls.__name__} (flags given as well override its values)")
    groups: dict[type, argparse._ArgumentGroup] = {}
    for s in settings(cls):
        if s.path in skip or (only is not None and s.path not in only):
            continue
        if s.owner not in groups:     # the class docstring "title: description" heads its flags
            title, _, text = (s.owner.__doc__ or s.owner.__name__).strip().partition(": ")
            groups[s.owner] = parser.add_argument_group(title, text or None)
        _add(groups[s.owner], s, prefix, (aliases or {}).get(s.path, ()), s.path in required)


def flag_values(cls: type, ns: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value} of the flags of `cls` that `ns` holds, i.e. that were given."""
    out = {}
    for s in settings(cls):
        if hasattr(ns, prefix + s.path):
            v = getattr(ns, prefix + s.path)
            out[s.path] = TRI_STATE[v] if s.tri_state else s.check(v) if s.choices else v
    return out


def config_from_args(cls: type, ns: argparse.Namespace, given: Mapping[str, Any] | None = None,
                     prefix: str = "") -> Any:
    """The `cls` that the flags in `ns` (and its `--config` file) describe. `given` supplies values
    by dotted path, for the fields `add_config_args` skipped; `prefix` as there. ConfigError for a
    bad file or value."""
    path = getattr(ns, CONFIG_DEST, None)
    layers = [given or {}, flag_values(cls, ns, prefix), read_config(cls, path) if path else {}]

    def value_of(s: Setting) -> Any:
        for layer in layers:
            if s.path in layer:
                return layer[s.path]
        if s.meta.env and os.environ.get(s.meta.env):
            return s.check(os.environ[s.meta.env])
        return MISSING if s.meta.cli_default is None else s.meta.cli_default
    return build(cls, value_of)
