"""Wire types: one declaration of a Rust type's shape serves every format.

Upstream's types are Rust structs and enums whose serde derive fixes how they look in postcard
(the TCP and gossip wire format), in TOML (run configs, saved state) and, through Anchor, in borsh.
Here a type is declared once, as a plain dataclass or enum annotated with the markers below
(`U16`, `Annotated[str, FixedStr(64)]`, ...), and each format walks the resulting `WireType` tree:

* `postcard.py` encodes and decodes bytes,
* `obj.py` converts to and from the plain objects of TOML/JSON, validating with pydantic so that a
  malformed config names the field that is wrong.

Rust enums come in two kinds: `RustEnum` (only unit variants: an `enum.Enum` whose value is the
variant index) and `DataEnum` (variants carrying data, declared with `variant(...)`).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from psyche.core.numeric import to_f32

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Markers placed in `Annotated[...]`


@dataclass(frozen=True)
class IntMarker:
    bits: int
    signed: bool

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.int_schema(self)

    @property
    def min(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def max(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def rust_name(self) -> str:
        return f"{'i' if self.signed else 'u'}{self.bits}"


@dataclass(frozen=True)
class FloatMarker:
    bits: int

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.float_schema(self)


@dataclass(frozen=True)
class SmallBoolMarker:
    """Upstream `SmallBoolean`: one byte, any non-zero value is true, an integer in TOML."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.small_bool_schema()


@dataclass(frozen=True)
class FixedStr:
    """Upstream `FixedString<N>`: at most N UTF-8 bytes, NUL padded on chain, a string elsewhere.

    Written `Annotated[str, FixedStr(64)]`: a type checker sees a `str`; the codecs read the
    capacity from the annotation.
    """

    capacity: int

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.fixed_str_schema(self)


@dataclass(frozen=True)
class FixedBytes:
    """`[u8; N]`: N raw bytes in postcard, an array of N integers in TOML.

    Written `Annotated[bytes, FixedBytes(32)]` (a type checker sees `bytes`).
    """

    length: int

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.bytes_schema(self)


class SizedListMarker:
    """A list marker whose pydantic schema checks the list's size (`FixedVec`, `Array`)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.sized_list_schema(handler(source), self)


@dataclass(frozen=True)
class FixedVec(SizedListMarker):
    """Upstream `FixedVec<T, N>`: a sequence of at most N items.

    Written `Annotated[list[Client], FixedVec(256)]` (a type checker sees the list).
    """

    capacity: int


@dataclass(frozen=True)
class Array(SizedListMarker):
    """`[T; N]`: exactly N items, no length prefix in postcard.

    Written `Annotated[list[Round], Array(4)]` (a type checker sees the list).
    """

    length: int


U8 = Annotated[int, IntMarker(8, False)]
U16 = Annotated[int, IntMarker(16, False)]
U32 = Annotated[int, IntMarker(32, False)]
U64 = Annotated[int, IntMarker(64, False)]
I8 = Annotated[int, IntMarker(8, True)]
I16 = Annotated[int, IntMarker(16, True)]
I32 = Annotated[int, IntMarker(32, True)]
I64 = Annotated[int, IntMarker(64, True)]
F32 = Annotated[float, FloatMarker(32)]
F64 = Annotated[float, FloatMarker(64)]
SmallBool = Annotated[bool, SmallBoolMarker()]


# --------------------------------------------------------------------------------------------
# Structs


def _f32_kind(hint: Any, owner: type) -> str | None:
    """'scalar' for an (optional) F32 annotation, 'list' for a list/array of F32, else None."""
    if isinstance(hint, str):
        # `from __future__ import annotations`: resolve in the defining module.
        try:
            hint = eval(hint, vars(sys.modules[owner.__module__]))
        except Exception:
            return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = {_f32_kind(a, owner) for a in typing.get_args(hint)} - {None}
        return kinds.pop() if len(kinds) == 1 else None
    if origin is Annotated:
        if any(isinstance(m, FloatMarker) and m.bits == 32 for m in hint.__metadata__):
            return "scalar"
        base = typing.get_args(hint)[0]
        if typing.get_origin(base) is list and _f32_kind(typing.get_args(base)[0], owner):
            return "list"
    if origin is list and _f32_kind(typing.get_args(hint)[0], owner) == "scalar":
        return "list"
    return None


@typing.overload
def struct(cls: type[T], /) -> type[T]: ...


@typing.overload
def struct(
    *, frozen: bool = False, eq: bool = True, kw_only: bool = False
) -> Callable[[type[T]], type[T]]: ...


@typing.dataclass_transform()
def struct(
    cls: type[T] | None = None, *, frozen: bool = False, eq: bool = True, kw_only: bool = False
) -> type[T] | Callable[[type[T]], type[T]]:
    """A dataclass whose field order is its wire order and whose configs reject unknown keys.

    Type checkers see it as `dataclass` (`dataclass_transform`): the generated `__init__` and
    fields are checked like any dataclass's.

    `kw_only=True` lets optional fields precede required ones, as they do in many upstream
    structs, without changing the wire order.
    """

    def wrap(c: type[T]) -> type[T]:
        from pydantic import ConfigDict

        f32_fields = {
            name: kind
            for name, hint in inspect.get_annotations(c).items()
            if (kind := _f32_kind(hint, c)) is not None
        }
        if f32_fields:
            user_post_init = c.__dict__.get("__post_init__")

            def __post_init__(self: Any) -> None:
                # An f32 field holds an f32 value however it was built, so every node computes
                # with the same number (upstream widens f32 config values to f64 at use).
                for name, kind in f32_fields.items():
                    value = getattr(self, name)
                    if value is None:
                        continue
                    if kind == "scalar":
                        object.__setattr__(self, name, to_f32(value))
                    else:
                        object.__setattr__(self, name, [to_f32(x) for x in value])
                if user_post_init is not None:
                    user_post_init(self)

            setattr(c, "__post_init__", __post_init__)  # noqa: B010 (a method mypy cannot see)
        dc: type[Any] = dataclass(c, frozen=frozen, eq=eq, kw_only=kw_only)
        dc.__pydantic_config__ = ConfigDict(extra="forbid")
        return dc

    return wrap(cls) if cls is not None else wrap


# --------------------------------------------------------------------------------------------
# Enums


class RustEnum(enum.Enum):
    """A Rust enum of unit variants: `.value` is the variant index, `.name` its spelling."""

    @classmethod
    def from_name(cls, name: str) -> RustEnum:
        try:
            return cls[name]
        except KeyError:
            raise ValueError(
                f"unknown {cls.__name__} variant {name!r}; expected one of "
                + ", ".join(repr(m.name) for m in cls)
            ) from None

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.unit_enum_schema(cls)


class _VariantSpec:
    __slots__ = ("payload",)

    def __init__(self, payload: Any) -> None:
        self.payload = payload


_UNIT = object()


def variant(payload: Any = _UNIT) -> Any:
    """Declare a `DataEnum` variant: `variant()` is a unit variant, `variant(T)` carries a `T`.

    Struct variants are written as a variant carrying a struct: serde encodes both the same way in
    postcard, TOML and JSON.
    """
    return _VariantSpec(payload)


class DataEnum:
    """Base of Rust enums whose variants carry data (serde's externally tagged representation).

    Each `variant(...)` in a subclass body becomes a nested subclass, so `Checkpoint.Hub(repo)`
    builds a value, `isinstance(x, Checkpoint)` holds for every variant, and
    `match x: case Checkpoint.Hub(repo): ...` works.
    """

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]] = ()

    # Set on the enum class:
    variants: ClassVar[tuple[type[DataEnum], ...]] = ()
    # Set on each variant class:
    index: ClassVar[int]
    variant_name: ClassVar[str]
    payload_type: ClassVar[Any]  # None for a unit variant
    enum_class: ClassVar[type[DataEnum]]
    # Set on each value of a newtype variant (a unit variant has none): its payload.
    value: Any

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_is_variant" in cls.__dict__:
            return
        found: list[type[DataEnum]] = []
        for name, spec in list(cls.__dict__.items()):
            if not isinstance(spec, _VariantSpec):
                continue
            is_unit = spec.payload is _UNIT
            namespace: dict[str, Any] = {
                "_is_variant": True,
                "index": len(found),
                "variant_name": name,
                "payload_type": None if is_unit else spec.payload,
                "enum_class": cls,
                "__qualname__": f"{cls.__qualname__}.{name}",
                "__module__": cls.__module__,
                "__slots__": () if is_unit else ("value",),
                "__match_args__": () if is_unit else ("value",),
            }
            var_cls = type(name, (_UnitVariant if is_unit else _NewtypeVariant, cls), namespace)
            setattr(cls, name, var_cls)
            found.append(var_cls)
        cls.variants = tuple(found)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.data_enum_schema(cls, handler)

    @classmethod
    def variant_by_name(cls, name: str) -> type[DataEnum] | None:
        for var in cls.variants:
            if var.variant_name == name:
                return var
        return None

    @classmethod
    def resolved_payload_type(cls) -> Any:
        """The payload type with string forward references resolved in the enum's module."""
        payload = cls.payload_type
        if isinstance(payload, str):
            module = sys.modules[cls.enum_class.__module__]
            payload = eval(payload, vars(module))
        return payload


class _UnitVariant:
    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__qualname__)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}()"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__qualname__} is immutable")


class _NewtypeVariant:
    __slots__ = ()
    value: Any  # the variant class declares the slot

    def __init__(self, value: Any) -> None:
        object.__setattr__(self, "value", value)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.value == other.value

    def __hash__(self) -> int:
        return hash((type(self).__qualname__, self.value))

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({self.value!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__qualname__} is immutable")

    def __reduce__(self) -> Any:
        return (type(self), (self.value,))


# --------------------------------------------------------------------------------------------
# Proxies: a type that is serialized as another type


class SerdeProxy:
    """Mixin for types with a custom serde impl upstream.

    Subclasses set `serde_proxy_type` (the shape serde writes) and implement `to_serde_proxy` and
    `from_serde_proxy` (which validates and may raise `ValueError`).
    """

    serde_proxy_type: ClassVar[Any]

    def to_serde_proxy(self) -> Any:
        raise NotImplementedError

    @classmethod
    def from_serde_proxy(cls, proxy: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        from psyche.core.serde import obj

        return obj.proxy_schema(cls, handler)


# --------------------------------------------------------------------------------------------
# The resolved tree


@dataclass(eq=False)
class WireType:
    """Base of the resolved type tree that the codecs walk."""


@dataclass(eq=False)
class WInt(WireType):
    marker: IntMarker


@dataclass(eq=False)
class WFloat(WireType):
    bits: int


@dataclass(eq=False)
class WBool(WireType):
    pass


@dataclass(eq=False)
class WSmallBool(WireType):
    pass


@dataclass(eq=False)
class WStr(WireType):
    capacity: int | None  # FixedString capacity in bytes


@dataclass(eq=False)
class WBytes(WireType):
    length: int | None  # fixed length ([u8; N]) or None (length prefixed)


@dataclass(eq=False)
class WOption(WireType):
    inner: WireType


@dataclass(eq=False)
class WSeq(WireType):
    item: WireType
    capacity: int | None


@dataclass(eq=False)
class WArray(WireType):
    item: WireType
    length: int


@dataclass(eq=False)
class WTuple(WireType):
    items: tuple[WireType, ...]


@dataclass(eq=False)
class WStruct(WireType):
    cls: type
    # Fields in wire (declaration) order.
    fields: list[tuple[str, WireType]] = dataclasses.field(default_factory=list)
    # Fields declared with `metadata={"wire": False}`: kept in TOML/JSON, absent from binary
    # formats (they are port extensions that upstream's byte layouts have no room for).
    local_fields: list[tuple[str, WireType]] = dataclasses.field(default_factory=list)
    # Fields declared with `metadata={"wire": "postcard"}` (after every other field): in TOML,
    # JSON and postcard, absent from borsh and the Solana account (port extensions appended to a
    # port-only struct, which the account has no room for; a decoder of those formats gives the
    # field its default).
    postcard_fields: list[tuple[str, WireType]] = dataclasses.field(default_factory=list)


@dataclass(eq=False)
class WUnitEnum(WireType):
    cls: type[RustEnum]


@dataclass(eq=False)
class WDataEnum(WireType):
    cls: type[DataEnum]
    # per variant, in index order: (variant class, payload wire type or None for unit)
    variants: list[tuple[type[DataEnum], WireType | None]] = dataclasses.field(default_factory=list)


@dataclass(eq=False)
class WProxy(WireType):
    cls: type
    proxy: WireType
    to_proxy: Callable[[Any], Any]
    from_proxy: Callable[[Any], Any]


_cache: dict[Any, WireType] = {}


def _type_key(tp: Any) -> Any:
    try:
        hash(tp)
        return tp
    except TypeError:
        return id(tp)


def wire_type(tp: Any) -> WireType:
    """Resolve a Python annotation into the `WireType` tree (cached per type)."""
    key = _type_key(tp)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    return _resolve(tp)


def _resolve(tp: Any) -> WireType:
    key = _type_key(tp)
    origin = typing.get_origin(tp)

    if origin is Annotated:
        base, *metadata = typing.get_args(tp)
        result = _resolve_annotated(base, metadata)
        _cache[key] = result
        return result

    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        non_none = [a for a in args if a is not type(None)]
        if len(args) == 2 and len(non_none) == 1:
            result = WOption(wire_type(non_none[0]))
            _cache[key] = result
            return result
        raise TypeError(f"only `T | None` unions have a wire form, not {tp!r}")

    if origin is list:
        (item,) = typing.get_args(tp)
        result = WSeq(wire_type(item), None)
        _cache[key] = result
        return result

    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            raise TypeError("variable-length tuples have no wire form; use list[T]")
        result = WTuple(tuple(wire_type(a) for a in args))
        _cache[key] = result
        return result

    if tp is bool:
        return _cache.setdefault(key, WBool())
    if tp is str:
        return _cache.setdefault(key, WStr(None))
    if tp is bytes:
        return _cache.setdefault(key, WBytes(None))
    if tp in (int, float):
        raise TypeError(f"bare {tp.__name__} has no wire form: annotate it (U64, I32, F32, ...)")

    if isinstance(tp, type):
        if issubclass(tp, SerdeProxy):
            proxy_wt = wire_type(tp.serde_proxy_type)
            result = WProxy(tp, proxy_wt, tp.to_serde_proxy, tp.from_serde_proxy)
            _cache[key] = result
            return result
        if issubclass(tp, RustEnum):
            return _cache.setdefault(key, WUnitEnum(tp))
        if issubclass(tp, DataEnum):
            enum_cls = tp.enum_class if "_is_variant" in tp.__dict__ else tp
            data_enum = WDataEnum(enum_cls)
            _cache[key] = data_enum  # registered before recursing: enums may nest themselves
            if enum_cls is not tp:
                _cache[_type_key(enum_cls)] = data_enum
            for var in enum_cls.variants:
                payload = var.resolved_payload_type() if var.payload_type is not None else None
                data_enum.variants.append((var, None if payload is None else wire_type(payload)))
            return data_enum
        if dataclasses.is_dataclass(tp):
            st = WStruct(tp)
            _cache[key] = st
            hints = typing.get_type_hints(tp, include_extras=True)
            for f in dataclasses.fields(tp):
                wire = f.metadata.get("wire", True)
                if wire == "postcard":
                    target = st.postcard_fields
                elif st.postcard_fields and wire is True:
                    raise TypeError(f"{tp.__name__}.{f.name}: postcard-only fields come last")
                else:
                    target = st.fields if wire else st.local_fields
                target.append((f.name, wire_type(hints[f.name])))
            return st

    raise TypeError(f"no wire form for {tp!r}")


def _resolve_annotated(base: Any, metadata: list[Any]) -> WireType:
    for m in metadata:
        if isinstance(m, IntMarker):
            return WInt(m)
        if isinstance(m, FloatMarker):
            return WFloat(m.bits)
        if isinstance(m, SmallBoolMarker):
            return WSmallBool()
        if isinstance(m, FixedStr):
            return WStr(m.capacity)
        if isinstance(m, FixedBytes):
            return WBytes(m.length)
        if isinstance(m, FixedVec | Array):
            (item,) = typing.get_args(base)
            if isinstance(m, FixedVec):
                return WSeq(wire_type(item), m.capacity)
            return WArray(wire_type(item), m.length)
    return wire_type(base)
