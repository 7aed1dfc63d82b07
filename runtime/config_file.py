"""Config files: the JSON of a config dataclass, nested configs as nested objects.

    {"engine": {"model": "/models/llama", "block_size": 16}, "role": "decode", "port": 7001}

What `splitserve serve` writes for each child (`--config FILE`) and what a Helm ConfigMap holds.
A file may leave fields out (they take their defaults); a field the class does not have, a value
of the wrong type or outside the field's choices is a ConfigError that names the field. Secrets
are never written and refused when read: they travel by environment (SPLITSERVE_API_KEY).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING
from enum import Enum
from pathlib import Path
from typing import Any

from runtime.config_fields import ConfigError, build, children, settings


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Every field of `cfg` except secrets, nested configs as nested dicts."""
    out: dict[str, Any] = {}
    for s in settings(type(cfg)):
        if s.meta.secret:
            continue
        *parents, name = s.path.split(".")
        node, value = out, cfg
        for p in parents:
            node, value = node.setdefault(p, {}), getattr(value, p)
        v = getattr(value, name)
        node[name] = v.value if isinstance(v, Enum) else v       # a choice as it is spelled
    return out


def flatten(cls: type, data: Any, where: str = "config") -> dict[str, Any]:
    """{dotted path: checked value} of the fields `data` sets; ConfigError for anything else."""
    out: dict[str, Any] = {}

    def walk(node: Any, owner: type, prefix: str) -> None:
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the top level'} must be an object "
                              f"({owner.__name__}), got {type(node).__name__}")
        known = {name: (nested, s) for name, nested, s in children(owner, prefix)}
        for key, value in node.items():
            if key not in known:
                raise ConfigError(f"{where}: unknown field {prefix + key!r} ({owner.__name__} has "
                                  f"{', '.join(known)})")
            nested, s = known[key]
            if nested is not None:
                walk(value, nested, f"{prefix}{key}.")
            elif s.meta.secret:
                raise ConfigError(f"{where}: {s.path} is a secret and is not read from files; "
                                  f"set {s.meta.env or s.flag}")
            else:
                try:
                    out[s.path] = s.check(value)
                except ConfigError as e:
                    raise ConfigError(f"{where}: {e}") from None
    walk(data, cls, "")
    return out


def config_from_dict(cls: type, data: Any, where: str = "config") -> Any:
    values = flatten(cls, data, where)
    return build(cls, lambda s: values.get(s.path, MISSING))


def read_config(cls: type, path: str | os.PathLike) -> dict[str, Any]:
    """The checked values a config file sets, by dotted path (see `flatten`)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"config file {path} is not JSON: {e}") from None
    return flatten(cls, data, str(path))


def config_json(cfg: Any) -> str:
    """`cfg` (secrets left out) as the JSON a config file holds."""
    return json.dumps(config_to_dict(cfg), indent=1)


def write_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write `cfg` (secrets left out) as JSON, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(config_json(cfg))
