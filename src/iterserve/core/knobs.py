"""How a knob is declared, and how its flag is made from the declaration.

A knob is a field of one of the config dataclasses in core/config.py whose metadata (`Knob`)
holds its help text, type, bounds, choices and CLI spelling. That field is the knob's one
declaration: `EngineArgs`'s field (engine/args.py), the flags of `iterserve serve` and
`iterserve generate`, and the lab's option (lab/options.py) are generated from it, so they
cannot disagree on a name, a bound or a default. Validation lives with the configs
(core/config.py `check_knob`, each config's `validate()`).

Three kinds of default, each said once:

- a value (`knob(16, ...)`);
- one value per device type (`knob(per_device(32, cuda=256), ...)`): the field holds the
  CPU's, `device_default` the rest, and `default_on(k, field_default, device)` is the one
  function that picks; EngineArgs leaves such a knob None until it knows the device;
- derived from other settings (`derived="how"`): EngineArgs leaves it None and its
  `create_*_config` derives it (the model's limit, the KV memory budget, ...); the text is
  the flag's help.

A knob may also exist only to be accepted (`no_effect="why"`: setting it logs one line at
start) or refused (`refused="why, and what it needs"`: setting it is a ConfigError), for
flags pasted from vLLM's command lines; see core/config.py `knob_notices`.

torch-free and stdlib-only: the lab and the CLI's help import it without the model layer.
"""

from __future__ import annotations

import argparse
import enum
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Iterable, Iterator, Mapping


@dataclass(frozen=True, slots=True)
class PerDevice:
    """A default that depends on the device type: `cpu`, unless `others` names the type."""

    cpu: Any
    others: tuple[tuple[str, Any], ...] = ()

    def on(self, device: Any) -> Any:
        return dict(self.others).get(device_type(device), self.cpu)

    def text(self) -> str:
        return "; ".join([f"{self.cpu} on CPU"] + [f"{v} on {d.upper()}" for d, v in self.others])


def per_device(cpu: Any, **others: Any) -> PerDevice:
    """`per_device(32, cuda=256)`: 32 on the CPU, 256 on CUDA devices."""
    return PerDevice(cpu, tuple(sorted(others.items())))


def device_type(device: Any) -> str:
    """"cuda:1" -> "cuda"; None -> "cpu" (the product's default device)."""
    return str(device or "cpu").split(":", 1)[0].strip().lower()


@dataclass(frozen=True, slots=True)
class Knob:
    """Metadata of one knob: enough to validate it, document it and make a flag for it."""

    help: str
    kind: type                        # int, float, bool, str, or an Enum class
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False   # minimum itself is not allowed (timeouts: > 0)
    nullable: bool = False            # None is a value (no limit / not given)
    choices_: tuple[str, ...] | None = None   # a str knob's fixed values (Enum kinds: theirs)
    flag: str | None = None           # CLI flag; default --name-with-dashes
    aliases: tuple[str, ...] = ()     # other spellings of the flag (vLLM's -tp, -dp)
    off_aliases: tuple[str, ...] = ()  # a bool knob's other spellings of --no-FLAG
    metavar: str | None = None
    repeat: bool = False              # the flag may be given several times (a list)
    group: str | None = None          # CLI argument group; default: the config's TITLE
    device_default: PerDevice | None = None   # the default of each device type
    derived: str | None = None        # None is derived from other settings: how (help text)
    no_effect: str | None = None      # accepted but without effect here: why
    refused: str | None = None        # refused when set: why, and what it needs
    parse: Any = None                 # the flag's text -> value (default: `kind`); JSON, "8G"
    nargs: str | None = None          # "+": the flag takes several values (a list)

    @property
    def choices(self) -> tuple[str, ...] | None:
        if isinstance(self.kind, type) and issubclass(self.kind, enum.Enum):
            return tuple(m.value for m in self.kind)
        return self.choices_

    @property
    def late_default(self) -> bool:
        """Whether EngineArgs leaves the knob None until it knows the device / the model."""
        return self.derived is not None or self.device_default is not None

    def bounds_text(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum:g}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum:g}")
        return ", ".join(parts)


def knob(default: Any, help: str, kind: type, *, choices: Iterable[str] | None = None,
         **meta: Any) -> Any:
    """A dataclass field carrying its Knob metadata; `default` may be `per_device(...)`."""
    if "short" in meta:                         # one extra spelling (-tp)
        meta["aliases"] = (*meta.get("aliases", ()), meta.pop("short"))
    if isinstance(default, PerDevice):
        meta["device_default"] = default
        default = default.cpu
    if meta.get("derived") is not None:
        meta.setdefault("nullable", default is None)
    k = Knob(help=help, kind=kind, choices_=tuple(choices) if choices is not None else None,
             **meta)
    return field(default=default, metadata={"knob": k})


def knob_fields(cls: type) -> Iterator[tuple[str, Any, Knob]]:
    """(name, default, Knob) for every knob of a config class, in declaration order."""
    for f in fields(cls):
        k = f.metadata.get("knob")
        if k is not None:
            yield f.name, (None if f.default is MISSING else f.default), k


def knobs_of(*classes: type) -> dict[str, tuple[Any, Knob, type]]:
    """name -> (default, Knob, config class) over several configs (names are unique)."""
    out: dict[str, tuple[Any, Knob, type]] = {}
    for cls in classes:
        for name, default, k in knob_fields(cls):
            if name in out:
                raise TypeError(f"knob {name!r} is declared by {out[name][2].__name__} "
                                f"and {cls.__name__}")
            out[name] = (default, k, cls)
    return out


def default_of(cls: type, name: str) -> Any:
    """The declared default of one knob of a config class."""
    for n, default, _ in knob_fields(cls):
        if n == name:
            return default
    raise KeyError(f"{cls.__name__} has no knob {name!r}")


def default_on(k: Knob, field_default: Any, device: Any = None) -> Any:
    """The knob's default on `device` (the one place a default depends on the device)."""
    return k.device_default.on(device) if k.device_default is not None else field_default


def flag_of(name: str, k: Knob) -> str:
    return k.flag or "--" + name.replace("_", "-")


def default_text(k: Knob, default: Any) -> str:
    """What --help says about the default."""
    if k.derived is not None:
        base = f"default {k.device_default.text()}; " if k.device_default is not None else ""
        return base + k.derived
    if k.device_default is not None:
        return "default " + k.device_default.text()
    if default is None:
        return ""
    return f"default {getattr(default, 'value', default)}"


def add_knob_argument(group: Any, name: str, k: Knob, default: Any,
                      derived_help: str | None = None) -> None:
    """One flag from a knob's metadata: --name-with-dashes, its type, choices, help text.

    Booleans get --flag / --no-flag. Values are checked by the config's validate() (so the
    CLI, the engine and the lab reject them with the same message), except choices, which
    argparse checks itself. `default` is the parser's default (None: "not given");
    `derived_help` replaces what the help says about the default."""
    flags = [flag_of(name, k), *k.aliases]
    extra = derived_help if derived_help is not None else default_text(k, default)
    bounds = k.bounds_text()
    text = k.help + (f" ({extra})" if extra else "") + (f" [{bounds}]" if bounds else "")
    text = text.replace("%", "%%")
    kw: dict[str, Any] = {"dest": name, "default": default, "help": text}
    if k.metavar:
        kw["metavar"] = k.metavar
    if k.kind is bool:
        kw.pop("metavar", None)
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        for off in k.off_aliases:
            group.add_argument(off, dest=name, action="store_false", default=default,
                               help=f"same as --no-{flags[0].removeprefix('--')}")
    elif k.kind is dict and k.parse is None:   # JSON text; check_knob parses it
        group.add_argument(*flags, type=str, **kw)
    elif k.repeat:
        group.add_argument(*flags, type=k.parse or k.kind, action="append", **kw)
    elif k.choices:
        group.add_argument(*flags, choices=list(k.choices), **kw)
    else:
        if k.nargs:
            kw["nargs"] = k.nargs
        group.add_argument(*flags, type=k.parse or k.kind, **kw)


def json_arg(kind: type) -> Any:
    """An argparse type for a JSON-valued flag (vLLM's `--default-chat-template-kwargs
    '{"enable_thinking": false}'`, `--allowed-origins '["http://a"]'`): the text must parse
    as JSON of `kind` (dict or list)."""
    import json

    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(
                f"must be a JSON {'object' if kind is dict else 'array'}, got {text!r}")
        return value

    parse.__name__ = "JSON"                     # argparse names the type in its errors
    return parse


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's spelling of sizes: "25.6k" = 25,600, "8G" = 8 x 2**30 (upper case is binary and
    takes whole numbers only), plain digits as they are."""
    import re

    value = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number (e.g. 8192, 32k, 8G)") from None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
            f"{number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


human_readable_int.__name__ = "size"


def add_config_arguments(parser: argparse.ArgumentParser, classes: Iterable[type], *,
                         defaults: Mapping[str, Any] | None = None,
                         groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every knob of `classes` as a flag, in one argument group per config (its TITLE, or
    the knob's own `group`). `defaults` overrides the parser's defaults by name (EngineArgs
    gives its own); `groups` are groups already made, by title, reused and returned."""
    groups = {} if groups is None else groups
    for cls in classes:
        for name, default, k in knob_fields(cls):
            title = k.group or getattr(cls, "TITLE", cls.__name__)
            if title not in groups:
                groups[title] = parser.add_argument_group(title)
            value = defaults[name] if defaults is not None and name in defaults else default
            add_knob_argument(groups[title], name, k, getattr(value, "value", value))
    return groups
