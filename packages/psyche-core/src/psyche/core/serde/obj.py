"""serde's data model as plain Python objects: what TOML and JSON files hold.

`to_obj` writes a value the way upstream's serde derive would (externally tagged enums, `None`
fields omitted, `[u8; N]` as integer arrays). `from_obj` reads one back through pydantic, so a
malformed file is reported field by field with the path of each bad value.

Two deliberate departures from upstream, both because upstream's behaviour loses data:
* unknown keys are an error (serde ignores them, so a typo silently does nothing);
* `u64` values above TOML's signed 64-bit range are written as decimal strings and read back from
  them (upstream's TOML serializer fails on them, so its saved states cannot be written).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, TypeVar, overload

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError, core_schema

from psyche.core.fixed import fixed_str_serialize
from psyche.core.numeric import I64_MAX, f32_shortest_repr, to_f32
from psyche.core.serde import schema
from psyche.core.serde.schema import Array as _ArrayMarker
from psyche.core.serde.schema import (
    DataEnum,
    FixedBytes,
    FixedStr,
    FixedVec,
    FloatMarker,
    IntMarker,
    RustEnum,
    SerdeProxy,
    SizedListMarker,
    wire_type,
)

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Serialization


def to_obj(value: Any, tp: Any = None, *, json: bool = False) -> Any:
    """The serde-data-model form of `value` (dicts, lists, str, int, float, bool). `json`: as
    serde_json writes it rather than TOML: `None` fields as `null`, every u64 as a number."""
    return _to_obj(value, wire_type(type(value) if tp is None else tp), json)


def _to_obj(v: Any, wt: schema.WireType, json: bool = False) -> Any:
    if isinstance(wt, schema.WInt):
        if not json and not wt.marker.signed and wt.marker.bits == 64 and v > I64_MAX:
            return str(v)
        return v
    if isinstance(wt, schema.WFloat):
        if wt.bits == 32:
            return float(f32_shortest_repr(v))
        return float(v)
    if isinstance(wt, schema.WBool):
        return bool(v)
    if isinstance(wt, schema.WSmallBool):
        return 1 if v else 0
    if isinstance(wt, schema.WStr):
        return v if wt.capacity is None else fixed_str_serialize(v, wt.capacity)
    if isinstance(wt, schema.WBytes):
        return list(v)
    if isinstance(wt, schema.WOption):
        return None if v is None else _to_obj(v, wt.inner, json)
    if isinstance(wt, schema.WSeq | schema.WArray):
        return [_to_obj(x, wt.item, json) for x in v]
    if isinstance(wt, schema.WTuple):
        return [_to_obj(x, t, json) for x, t in zip(v, wt.items)]
    if isinstance(wt, schema.WStruct):
        out = {}
        for name, ft in (*wt.fields, *wt.local_fields, *wt.postcard_fields):
            item = _to_obj(getattr(v, name), ft, json)
            if item is not None or json:
                out[name] = item
        return out
    if isinstance(wt, schema.WUnitEnum):
        return v.name
    if isinstance(wt, schema.WDataEnum):
        for var, payload in wt.variants:
            if type(v) is var:
                if payload is None:
                    return var.variant_name
                return {var.variant_name: _to_obj(v.value, payload, json)}
        raise TypeError(f"{v!r} is not a {wt.cls.__name__}")
    if isinstance(wt, schema.WProxy):
        return _to_obj(wt.to_proxy(v), wt.proxy, json)
    raise TypeError(f"cannot serialize {wt!r}")


# --------------------------------------------------------------------------------------------
# Deserialization


class SerdeError(ValueError):
    """A file or object that does not match the expected type; `problems` lists each bad field."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        lines = [f"{path or '<top level>'}: {msg}" for path, msg in problems]
        prefix = f"{source}: " if source else ""
        if len(lines) == 1:
            super().__init__(prefix + lines[0])
        else:
            super().__init__(prefix + f"{len(lines)} problems:\n  " + "\n  ".join(lines))


@cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


# A class gives its instances' type; any other type form (Annotated, unions, ...) gives Any.
@overload
def from_obj(obj: Any, tp: type[T], *, source: str | None = None) -> T: ...
@overload
def from_obj(obj: Any, tp: Any, *, source: str | None = None) -> Any: ...
def from_obj(obj: Any, tp: Any, *, source: str | None = None) -> Any:
    """Validate a serde-data-model object into `tp`; raises `SerdeError` naming every bad field."""
    try:
        return _adapter(tp).validate_python(_prepare(obj, wire_type(tp)))
    except ValidationError as e:
        raise SerdeError([_describe(err) for err in e.errors()], source) from None


def _prepare(obj: Any, wt: schema.WireType) -> Any:
    """Bring serde's readings that pydantic does not know into `obj` before validation:

    * a struct's missing `Option` field reads as None (and `to_obj` leaves None out);
    * a `Vec<u8>` (`bytes`) is an array of integers, as `to_obj` writes it.

    Returns a copy where anything changed; the caller's object is never modified."""
    if isinstance(wt, schema.WBytes) and wt.length is None and isinstance(obj, list):
        if all(type(x) is int and 0 <= x <= 255 for x in obj):
            return bytes(obj)
        return obj
    if isinstance(wt, schema.WStruct) and isinstance(obj, dict):
        out = None
        optional = _options_without_default(wt.cls)
        for name, ft in (*wt.fields, *wt.local_fields, *wt.postcard_fields):
            if name not in obj:
                if name in optional:
                    out = dict(obj) if out is None else out
                    out[name] = None
                continue
            item = _prepare(obj[name], ft)
            if item is not obj[name]:
                out = dict(obj) if out is None else out
                out[name] = item
        return obj if out is None else out
    if isinstance(wt, schema.WOption):
        return obj if obj is None else _prepare(obj, wt.inner)
    if isinstance(wt, schema.WSeq | schema.WArray) and isinstance(obj, list):
        items = [_prepare(x, wt.item) for x in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else items
    if isinstance(wt, schema.WTuple) and isinstance(obj, list | tuple):
        items = [_prepare(x, t) for x, t in zip(obj, wt.items)]
        items.extend(obj[len(items) :])
        return obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
    if isinstance(wt, schema.WDataEnum) and isinstance(obj, dict) and len(obj) == 1:
        ((tag, payload),) = obj.items()
        for var, payload_wt in wt.variants:
            if var.variant_name == tag and payload_wt is not None:
                item = _prepare(payload, payload_wt)
                return obj if item is payload else {tag: item}
        return obj
    if isinstance(wt, schema.WProxy):
        return _prepare(obj, wt.proxy)
    return obj


@cache
def _options_without_default(cls: type) -> frozenset[str]:
    """Fields of type `T | None` that have no Python default (a default wins over None)."""
    wt = wire_type(cls)
    assert isinstance(wt, schema.WStruct)
    kinds = dict((*wt.fields, *wt.local_fields, *wt.postcard_fields))
    return frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if isinstance(kinds.get(f.name), schema.WOption)
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )


def format_path(loc: Sequence[str | int]) -> str:
    """`('model', 'LLM', 'data_locations', 1)` → `model.LLM.data_locations[1]`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _describe(err: Any) -> tuple[str, str]:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return format_path(loc), "unknown key (not a field of this table; check the spelling)"
    if kind == "missing":
        return format_path(loc), "missing required field"
    msg = err["msg"]
    if kind in ("dataclass_type", "dataclass_exact_type", "model_type", "dict_type"):
        msg = f"expected a table, found {_describe_input(err.get('input'))}"
    elif kind in ("list_type", "tuple_type"):
        msg = f"expected an array, found {_describe_input(err.get('input'))}"
    return format_path(loc), msg


def _describe_input(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {value!r}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"float {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list | tuple):
        return "an array"
    return type(value).__name__


def _error(kind: str, message: str, /, **ctx: Any) -> PydanticCustomError:
    return PydanticCustomError(kind, message, ctx)


# ---- pydantic schemas for the markers, enums and proxies --------------------------------------


def int_schema(marker: IntMarker) -> core_schema.CoreSchema:
    lo, hi, name = marker.min, marker.max, marker.rust_name
    big_u64 = not marker.signed and marker.bits == 64

    def validate(v: Any) -> int:
        if big_u64 and isinstance(v, str) and v.isdigit() and I64_MAX < int(v) <= hi:
            return int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _error(
                "wire_type",
                "expected an integer ({name}), found {found}",
                name=name,
                found=_describe_input(v),
            )
        if not lo <= v <= hi:
            raise _error(
                "wire_range",
                "{value} is out of range for {name} ({lo}..={hi})",
                value=v,
                name=name,
                lo=lo,
                hi=hi,
            )
        return v

    return core_schema.no_info_plain_validator_function(validate)


def float_schema(marker: FloatMarker) -> core_schema.CoreSchema:
    bits = marker.bits

    def validate(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise _error(
                "wire_type",
                "expected a number (f{bits}), found {found}",
                bits=bits,
                found=_describe_input(v),
            )
        if bits == 32:
            try:
                return to_f32(float(v))
            except OverflowError:
                raise _error("wire_range", "{value} is out of range for f32", value=v) from None
        return float(v)

    return core_schema.no_info_plain_validator_function(validate)


def small_bool_schema() -> core_schema.CoreSchema:
    def validate(v: Any) -> bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, int) and 0 <= v <= 255:
            return v != 0
        raise _error(
            "wire_type",
            "expected a boolean or an integer 0..=255, found {found}",
            found=_describe_input(v),
        )

    return core_schema.no_info_plain_validator_function(validate)


def fixed_str_schema(marker: FixedStr) -> core_schema.CoreSchema:
    cap = marker.capacity

    def validate(v: Any) -> str:
        if not isinstance(v, str):
            raise _error("wire_type", "expected a string, found {found}", found=_describe_input(v))
        n = len(v.encode("utf-8"))
        if n > cap:
            raise _error(
                "wire_capacity",
                "string of {n} bytes doesn't fit in FixedString<{cap}> (at most {cap} UTF-8 bytes)",
                n=n,
                cap=cap,
            )
        return v

    return core_schema.no_info_plain_validator_function(validate)


def bytes_schema(marker: FixedBytes | None) -> core_schema.CoreSchema:
    length = None if marker is None else marker.length

    def validate(v: Any) -> bytes:
        if isinstance(v, bytes | bytearray):
            out = bytes(v)
        elif isinstance(v, list | tuple):
            if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 255 for x in v):
                raise _error("wire_type", "expected an array of integers 0..=255")
            out = bytes(v)
        else:
            raise _error(
                "wire_type",
                "expected an array of bytes, found {found}",
                found=_describe_input(v),
            )
        if length is not None and len(out) != length:
            raise _error(
                "wire_length",
                "expected exactly {length} bytes, found {n}",
                length=length,
                n=len(out),
            )
        return out

    return core_schema.no_info_plain_validator_function(validate)


def sized_list_schema(
    inner: core_schema.CoreSchema, marker: SizedListMarker
) -> core_schema.CoreSchema:
    if isinstance(marker, _ArrayMarker):
        exact, bound = True, marker.length
    elif isinstance(marker, FixedVec):
        exact, bound = False, marker.capacity
    else:
        raise TypeError(f"not a list size marker: {marker!r}")

    def check(v: list[Any]) -> list[Any]:
        if exact and len(v) != bound:
            raise _error(
                "wire_length", "expected exactly {n} items, found {found}", n=bound, found=len(v)
            )
        if len(v) > bound:
            raise _error(
                "wire_capacity", "at most {n} items fit, found {found}", n=bound, found=len(v)
            )
        return v

    return core_schema.no_info_after_validator_function(check, inner)


def unit_enum_schema(cls: type[RustEnum]) -> core_schema.CoreSchema:
    names = ", ".join(repr(m.name) for m in cls)

    def validate(v: Any) -> RustEnum:
        if isinstance(v, cls):
            return v
        if isinstance(v, str) and v in cls.__members__:
            return cls[v]
        raise _error(
            "wire_variant",
            "unknown {enum} variant {found}; expected one of {names}",
            enum=cls.__name__,
            found=_describe_input(v),
            names=names,
        )

    return core_schema.no_info_plain_validator_function(validate)


def data_enum_schema(cls: type[DataEnum], handler: Any) -> core_schema.CoreSchema:
    enum_cls = cls.enum_class if "_is_variant" in cls.__dict__ else cls
    names = ", ".join(repr(v.variant_name) for v in enum_cls.variants)
    by_name = {v.variant_name: v for v in enum_cls.variants}
    choices: dict[Any, core_schema.CoreSchema] = {}
    for var in enum_cls.variants:
        if var.payload_type is None:

            def unit(v: Any, var: type[DataEnum] = var) -> Any:
                return v if isinstance(v, var) else var()

            choices[var.variant_name] = core_schema.no_info_plain_validator_function(unit)
        else:
            inner = handler.generate_schema(var.resolved_payload_type())

            def unwrap(v: Any, var: type[DataEnum] = var) -> Any:
                if isinstance(v, var):
                    return v.value
                return v[var.variant_name]

            # A newtype variant class takes its payload (`_NewtypeVariant.__init__`).
            def wrap(x: Any, var: Callable[[Any], DataEnum] = var) -> Any:
                return var(x)

            choices[var.variant_name] = core_schema.no_info_after_validator_function(
                wrap, core_schema.no_info_before_validator_function(unwrap, inner)
            )

    def tag_of(v: Any) -> str | None:
        if isinstance(v, enum_cls):
            name: str = type(v).variant_name
            return name
        if isinstance(v, str):
            return v
        if isinstance(v, dict) and len(v) == 1:
            key: str = next(iter(v))
            return key
        return None

    def check(v: Any) -> Any:
        tag = tag_of(v)
        if tag is None:
            raise _error(
                "wire_variant",
                "expected one {enum} variant: a name or a table with exactly one key "
                "(one of {names}), found {found}",
                enum=enum_cls.__name__,
                names=names,
                found=_describe_input(v),
            )
        var = by_name.get(tag)
        if var is None:
            raise _error(
                "wire_variant",
                "unknown {enum} variant '{tag}'; expected one of {names}",
                enum=enum_cls.__name__,
                tag=tag,
                names=names,
            )
        if isinstance(v, str) and var.payload_type is not None:
            raise _error(
                "wire_variant",
                "{enum} variant '{tag}' needs a value: write it as a table `{tag} = ...`",
                enum=enum_cls.__name__,
                tag=tag,
            )
        if isinstance(v, dict) and var.payload_type is None:
            raise _error(
                "wire_variant",
                "{enum} variant '{tag}' carries no value: write it as the string '{tag}'",
                enum=enum_cls.__name__,
                tag=tag,
            )
        return v

    union = core_schema.tagged_union_schema(choices=choices, discriminator=tag_of)
    return core_schema.no_info_before_validator_function(check, union)


def proxy_schema(cls: type[SerdeProxy], handler: Any) -> core_schema.CoreSchema:
    inner = handler.generate_schema(cls.serde_proxy_type)

    def build(proxy: Any) -> Any:
        try:
            return cls.from_serde_proxy(proxy)
        except ValueError as e:
            raise _error("wire_value", "{message}", message=str(e)) from None

    def validate(v: Any, inner_validate: Any) -> Any:
        if isinstance(v, cls):
            return v
        return build(inner_validate(v))

    return core_schema.no_info_wrap_validator_function(validate, inner)
