"""Command options derived from the config dataclasses (nmt/config.py), so that each
setting's name, type, default and help are written once, on its field.

`nmt train` takes every documented field of ModelConfig and TrainConfig this way, `nmt
translate` every field of DecodeConfig and RuntimeConfig.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any

import typer


def config_options(cls: type, names: Iterable[str] | None = None,
                   shown: Callable[[dataclasses.Field[Any]], str] = lambda f: str(f.default),
                   ) -> list[inspect.Parameter]:
    """One Typer option per field of dataclass `cls` (only `names`, if given), in field
    order, as keyword parameters for a command's signature. From the field's metadata:
    `help`; `flag` (else `--field-name`, or `--field-name/--no-field-name` for a bool);
    `shown_default` (else `shown(field)`, the field's default). The default is None,
    meaning "not given", so a recipe or the config's default can fill it in (see
    nmt.train.settings.resolve); the type is the field's, without None (`int | None` ->
    int) and with a Literal of strings as str."""
    hints = typing.get_type_hints(cls)
    wanted = None if names is None else set(names)
    params = []
    for field in dataclasses.fields(cls):
        if wanted is not None and field.name not in wanted:
            continue
        meta, hint = field.metadata, hints[field.name]
        option = typer.Option(None, option_flag(field, hint), help=meta.get("help"),
                              show_default=meta.get("shown_default") or shown(field))
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                        default=option, annotation=_plain_type(hint)))
    return params


def option_flag(field: dataclasses.Field[Any], hint: Any) -> str:
    """The option declaration of a config field (`hint`: its resolved type): its metadata's
    `flag`, else `--field-name`, or `--field-name/--no-field-name` for a bool. Also what
    docs/generate.py lists beside each field of the API reference."""
    dashed = field.name.replace("_", "-")
    return field.metadata.get("flag") or (
        f"--{dashed}/--no-{dashed}" if hint is bool else f"--{dashed}")


def _plain_type(hint: Any) -> Any:
    """The type Typer parses an option as: `int | None` -> int, `Literal["a", "b"]` -> str."""
    origin = typing.get_origin(hint)
    if origin is None:
        return hint
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return type(args[0]) if origin is typing.Literal else args[0]


def with_options(func: Callable[..., None], after: str, options: list[inspect.Parameter]
                 ) -> Callable[..., None]:
    """Give `func` (whose `**settings` takes them) the `options` after its option named
    `after`: Typer builds a command's options from `inspect.signature`, which reads
    `__signature__`."""
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
           for p in inspect.signature(func, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    at = [p.name for p in own].index(after) + 1
    func.__signature__ = inspect.Signature([*own[:at], *options, *own[at:]])  # type: ignore[attr-defined]
    return func


def given(cls: type, settings: dict[str, Any]) -> dict[str, Any]:
    """The `settings` that are fields of dataclass `cls` and were given (not None)."""
    names = {field.name for field in dataclasses.fields(cls)}
    return {k: v for k, v in settings.items() if k in names and v is not None}
