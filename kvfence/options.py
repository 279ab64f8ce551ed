"""Options declared once, as dataclass fields: each carries its type (`Literal[...]` for a
choice), its default and one line of help, and kvfence.cli makes every command's flags from them.

Free of torch, so that packages which only talk HTTP (audit/) can declare their options.
"""

import functools
import importlib
from dataclasses import MISSING, Field, field
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    positional: bool = False,
    nargs: str | None = None,
    choices: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line argument. `help` is its line in --help and
    in the README; `flag` replaces the one derived from the field's name (--max-num-seqs for
    max_num_seqs, --no-prefix-cache for a bool that is on by default); `positional` makes it an
    argument without a flag (a list one takes the rest of the command line); `nargs="+"` lets a
    list's flag take several values at once; `choices` names a registry ("module:NAME") whose
    keys are the allowed values, where no Literal can. A default of MISSING makes it required;
    a list default makes the flag repeatable."""
    metadata = {
        "help": help,
        "flag": flag,
        "metavar": metavar,
        "positional": positional,
        "nargs": nargs,
        "choices": choices,
    }
    if isinstance(default, list):  # each instance gets a list of its own
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def is_option(f: Field) -> bool:
    """Whether a field was declared with option(): only those are command-line arguments."""
    return "help" in f.metadata


def default_of(f: Field) -> Any:
    """A field's default; MISSING where it has none."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


@functools.cache
def option_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def value_type(annotation: Any) -> Any:
    """An option's type without the None that means "not given": int for `int | None`."""
    if get_origin(annotation) in (Union, UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not NoneType]
    return annotation


def choices(annotation: Any) -> tuple[str, ...] | None:
    """The values a `Literal[...]` option allows; None for an option that is not a choice."""
    kind = value_type(annotation)
    return get_args(kind) if get_origin(kind) is Literal else None


def field_choices(cls: type, f: Field) -> tuple[str, ...] | None:
    """The values a field allows: the keys of the registry its option names ("module:NAME",
    imported only when asked), else its Literal's; None for a field that is not a choice."""
    registry = f.metadata.get("choices")
    if registry:
        module, name = registry.split(":")
        return tuple(getattr(importlib.import_module(module), name))
    return choices(option_types(cls)[f.name])
