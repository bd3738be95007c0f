"""Messages declared once: a frozen dataclass whose fields are annotated with how each one
crosses the wire (`Annotated[type, Wire(...)]`), read by one encoder and one decoder.

A field is written under its own name, in declaration order, and read back by its Wire's
parser, which bounds it and raises ValueError (or ProtocolError) on anything else; the
decoder turns every such error into a ProtocolError naming the message. A field absent from
a frame, or null, reads as None when it is nullable, else as its default; a field with
neither is required. Adding a field to a message is adding its line.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, ClassVar, Iterator, Mapping, TypeVar, get_args, get_origin, get_type_hints

from mesh.framing import ProtocolError

M = TypeVar("M", bound="Declared")
NOTHING: Any = type("Nothing", (), {"__repr__": lambda self: "NOTHING"})()  # no default: the field is required


@dataclass(frozen=True)
class Wire:
    """How one field crosses the wire."""

    parse: Callable[[Any, str], Any]  # (wire value, field name) -> value; ValueError when malformed
    dump: Callable[[Any], Any] | None = None  # value -> JSON (None: the value as it is)
    nullable: bool = False  # null, or the field absent, reads as None
    omit: bool = False  # left out of the frame while it holds its default
    inline: bool = False  # a Declared value whose fields are written among the message's own
    absent: Any = NOTHING  # what a field with no default reads as when null or absent
    holds: type | None = None  # the Declared type the field holds (one, or a list of them)


@dataclass(frozen=True)
class FieldSpec:
    """A declared field: its name, its Wire, its default (NOTHING: none; a factory makes a
    fresh one for each message) and whether it holds a list."""

    name: str
    wire: Wire
    default: Any
    factory: Callable[[], Any] | None = None
    many: bool = False

    def fresh_default(self) -> Any:
        return self.default if self.factory is None else self.factory()

    @property
    def required(self) -> bool:
        return self.default is NOTHING and self.wire.absent is NOTHING and not self.wire.nullable

    def read(self, m: Mapping[str, Any]) -> Any:
        """This field's value in message `m` (ValueError, KeyError or ProtocolError if malformed)."""
        if self.wire.inline:
            return self.wire.parse(m, self.name)
        raw = m.get(self.name)
        if raw is None:
            if self.wire.nullable:
                return None
            if self.default is not NOTHING:
                return self.fresh_default()
            if self.wire.absent is not NOTHING:
                return self.wire.absent
            if self.name not in m:
                raise KeyError(self.name)
        return self.wire.parse(raw, self.name)


_FIELDS: dict[type, tuple[FieldSpec, ...]] = {}


def declared_fields(cls: type) -> tuple[FieldSpec, ...]:
    """The fields of a Declared class, in order, with their Wires (read once per class)."""
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = _read_fields(cls)
    return found


def _read_fields(cls: type) -> tuple[FieldSpec, ...]:
    hints = get_type_hints(cls, include_extras=True)
    out = []
    for f in fields(cls):
        wire = next((w for w in getattr(hints[f.name], "__metadata__", ()) if isinstance(w, Wire)), None)
        if wire is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no Wire annotation")
        factory = None if f.default_factory is MISSING else f.default_factory
        default = f.default if factory is None else factory()
        out.append(FieldSpec(f.name, wire, NOTHING if default is MISSING else default, factory,
                             get_origin(get_args(hints[f.name])[0]) is list))
    return tuple(out)


def plain(value: Any) -> Any:
    """A value as JSON holds it: a Declared value as its fields, containers copied."""
    if isinstance(value, Declared):
        return value.to_fields()
    if isinstance(value, (list, tuple)):  # a list holds one kind of item: a list of scalars is copied whole
        if not value or not isinstance(value[0], (Declared, list, tuple, dict)):
            return list(value)
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


@contextmanager
def malformed(what: str) -> Iterator[None]:
    """Turn what a decoder meets in a malformed message (a missing key, a wrong type, a value
    out of bounds) into a ProtocolError naming the message."""
    try:
        yield
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError, RecursionError) as exc:
        raise ProtocolError(f"bad {what}: {exc}") from exc


class Declared:
    """A message (or a part of one) whose fields are declared with Wires: `to_fields()`
    writes it, `from_fields()` reads it back or raises ProtocolError ("bad WHAT: ...")."""

    __slots__ = ()
    WHAT: ClassVar[str] = ""

    @classmethod
    def what(cls) -> str:
        """How a decode error names this message."""
        return cls.WHAT or cls.__name__

    def to_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in declared_fields(type(self)):
            value = getattr(self, f.name)
            if f.wire.omit and value == f.fresh_default():
                continue
            value = f.wire.dump(value) if f.wire.dump is not None else plain(value)
            if f.wire.inline:
                out.update(value)
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_fields(cls: type[M], m: Any) -> M:
        with malformed(cls.what()):
            if not isinstance(m, Mapping):
                raise ValueError(f"an object expected, got {type(m).__name__}")
            return cls(**{f.name: f.read(m) for f in declared_fields(cls)}).checked()

    def checked(self: M) -> M:
        """The message as read, after the rules across its fields (ValueError if one fails)."""
        return self


def nested(kind: type[Declared], **options: Any) -> Wire:
    """A field holding one `kind` (its own decode errors name it)."""
    return Wire(lambda value, name: kind.from_fields(value), holds=kind, **options)


def listed(parse: Callable[[Any, str], Any], item: str) -> Callable[[Any, str], list[Any]]:
    """A parser of a list whose items `parse` reads, naming each `item`."""
    def parse_list(value: Any, name: str) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {type(value).__name__}")
        return [parse(x, item) for x in value]
    return parse_list


def nested_list(kind: type[Declared], **options: Any) -> Wire:
    """A field holding a list of `kind`."""
    return Wire(listed(lambda value, name: kind.from_fields(value), kind.what()), holds=kind, **options)
