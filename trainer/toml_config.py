"""Load a pydantic config model from a TOML file plus dotted overrides.

The one loader behind ``node.config.load`` and ``trainer.config.load_trainer_config``
(node may import trainer; trainer may not import node). Every failure is a
``ConfigError`` that names the file (or ``config`` when there is none): a missing
file, invalid TOML, and each offending key with pydantic's message. Unknown keys
are rejected by the models themselves (``extra="forbid"``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from verify.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def load_toml_model(
    cls: type[M],
    path: str | Path | None,
    overrides: dict[str, Any] | None = None,
    *,
    table: str | None = None,
) -> M:
    """Read ``path`` (TOML) into ``cls``; ``None`` gives the defaults.

    ``table``: when the file has a top-level table of that name, only it is read
    (the file may also be flat). ``overrides`` maps dotted keys (``"node.port"``)
    to values set after reading, creating intermediate tables as needed. A
    ``ConfigError`` raised by a model validator is re-raised with the file name.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
        if table is not None:
            data = data.get(table, data)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value
    try:
        return cls.model_validate(data)
    except ConfigError as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path or 'config'}: {problems}") from None
