"""Anchor IDLs of the three Psyche programs, in the pre-0.30 ("legacy") format anchorpy reads.

Upstream builds with `anchor build --no-idl`, so there is no IDL to copy; these are written from
the same declarations the encoders use (`psyche.solana.instructions` and `.state`, which mirror
upstream's Rust sources). The committed files under `idl/` are regenerated with
`python -m psyche.solana.idl --write`; tests check that the files equal a fresh generation and
that anchorpy, reading the files, encodes and decodes exactly what our borsh codec does.

Notes on the mapping: names are snake_case as in the Rust sources (anchorpy snake-cases names
anyway); `FixedString<L>` is `[u8; L]`; each `FixedVec<T, N>` becomes a struct `{data: [T; N],
len: u64}` named after T and N (the legacy format has no generics); `SmallBoolean` is a `u8`;
a bloom filter is `{keys: [u64; K], bits: [u64; U]}`. The zero-copy `CoordinatorAccount` is left
out of `accounts`: it is not borsh, so no IDL client can decode it (use `psyche.solana.state`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from psyche.coordinator.model import HttpTrainingDataLocation
from psyche.core.bloom import Bloom
from psyche.core.definitions import OptimizerDefinition
from psyche.core.serde import DataEnum, RustEnum
from psyche.core.serde.schema import (
    Array,
    FixedBytes,
    FixedStr,
    FixedVec,
    FloatMarker,
    IntMarker,
    SmallBoolMarker,
)
from psyche.solana.anchor import (
    AUTHORIZER_ERRORS,
    COORDINATOR_ERRORS,
    TREASURER_ERRORS,
    ProgramErrorSpec,
)
from psyche.solana.instructions import INSTRUCTIONS
from psyche.solana.instructions.spec import InstructionSpec
from psyche.solana.program_ids import DEFAULT_PROGRAM_IDS, ProgramIds
from psyche.solana.pubkey import PUBKEY_MARKER
from psyche.solana.state import (
    Authorization,
    CoordinatorInstance,
    Participant,
    TreasurerRun,
    anchor_account_name,
)
from psyche.solana.verification import RunVerification

IDL_VERSION = "0.1.0"
PROGRAM_NAMES = {
    "coordinator": "psyche_solana_coordinator",
    "authorizer": "psyche_solana_authorizer",
    "treasurer": "psyche_solana_treasurer",
}
_ACCOUNTS: dict[str, tuple[type, ...]] = {
    "coordinator": (CoordinatorInstance, RunVerification),
    "authorizer": (Authorization,),
    "treasurer": (TreasurerRun, Participant),
}
_ERRORS: dict[str, tuple[ProgramErrorSpec, ...]] = {
    "coordinator": COORDINATOR_ERRORS,
    "authorizer": AUTHORIZER_ERRORS,
    "treasurer": TREASURER_ERRORS,
}
# Enum variants that are struct variants upstream (`Gcp { bucket_name, .. }`); the others carry
# a tuple. Both are encoded the same way, only the IDL shape differs.
_STRUCT_VARIANTS = {
    (HttpTrainingDataLocation, "NumberedFiles"),
    (HttpTrainingDataLocation, "Gcp"),
    (OptimizerDefinition, "AdamW"),
    (OptimizerDefinition, "Distro"),
    (OptimizerDefinition, "DiLoCo"),
    (OptimizerDefinition, "DistroSparse"),
}
_BLOOM_NAMES = {(16, 8): "WitnessBloom"}


class _TypeCollector:
    """Turns Python declarations into IDL types, collecting the named types it meets."""

    def __init__(self) -> None:
        self.types: dict[str, dict[str, Any]] = {}

    def fields(self, cls: type) -> list[dict[str, Any]]:
        hints = typing.get_type_hints(cls, include_extras=True)
        return [
            {"name": f.name, "type": self.idl_type(hints[f.name])}
            for f in dataclasses.fields(cls)
            if f.metadata.get("wire", True) is True  # what borsh carries
        ]

    def idl_type(self, tp: Any) -> Any:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            base, *meta = typing.get_args(tp)
            return self._annotated(base, meta)
        if origin in (typing.Union, types.UnionType):
            (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
            return {"option": self.idl_type(inner)}
        if origin is list:
            (item,) = typing.get_args(tp)
            return {"vec": self.idl_type(item)}
        if tp is bool:
            return "bool"
        if tp is str:
            return "string"
        if tp is bytes:
            return "bytes"
        if isinstance(tp, type):
            if issubclass(tp, Bloom):
                return {"defined": self._bloom(tp)}
            if issubclass(tp, RustEnum):
                return {"defined": self._unit_enum(tp)}
            if issubclass(tp, DataEnum):
                enum_cls = tp.enum_class if "_is_variant" in tp.__dict__ else tp
                return {"defined": self._data_enum(enum_cls)}
            if dataclasses.is_dataclass(tp):
                return {"defined": self._struct(tp)}
        raise TypeError(f"no IDL type for {tp!r}")

    def _annotated(self, base: Any, meta: list[Any]) -> Any:
        for m in meta:
            if isinstance(m, IntMarker):
                return m.rust_name
            if isinstance(m, FloatMarker):
                return f"f{m.bits}"
            if isinstance(m, SmallBoolMarker):
                return "u8"
            if isinstance(m, FixedStr):
                return {"array": ["u8", m.capacity]}
            if isinstance(m, FixedBytes):
                if any(x is PUBKEY_MARKER for x in meta):
                    return "publicKey"
                return {"array": ["u8", m.length]}
            if isinstance(m, Array):
                (item,) = typing.get_args(base)
                return {"array": [self.idl_type(item), m.length]}
            if isinstance(m, FixedVec):
                (item,) = typing.get_args(base)
                return {"defined": self._fixed_vec(item, m.capacity)}
        return self.idl_type(base)

    def _register(self, name: str, body: dict[str, Any]) -> str:
        existing = self.types.get(name)
        if existing and existing != body:
            raise TypeError(f"two different IDL types named {name}")
        self.types[name] = body
        return name

    def _struct(self, cls: type) -> str:
        name = anchor_account_name(cls)
        if name in self.types:
            return name
        self.types[name] = {}  # placeholder against recursion
        return self._register(name, {"kind": "struct", "fields": self.fields(cls)})

    def _unit_enum(self, cls: type[RustEnum]) -> str:
        variants = [{"name": m.name} for m in cls]
        return self._register(cls.__name__, {"kind": "enum", "variants": variants})

    def _data_enum(self, cls: type[DataEnum]) -> str:
        variants: list[dict[str, Any]] = []
        for var in cls.variants:
            if var.payload_type is None:
                variants.append({"name": var.variant_name})
                continue
            payload = var.resolved_payload_type()
            if (cls, var.variant_name) in _STRUCT_VARIANTS:
                variants.append({"name": var.variant_name, "fields": self.fields(payload)})
            else:
                variants.append({"name": var.variant_name, "fields": [self.idl_type(payload)]})
        return self._register(cls.__name__, {"kind": "enum", "variants": variants})

    def _fixed_vec(self, item: Any, capacity: int) -> str:
        item_type = self.idl_type(item)
        item_name = _type_label(item_type)
        return self._register(
            f"FixedVec{item_name}{capacity}",
            {
                "kind": "struct",
                "fields": [
                    {"name": "data", "type": {"array": [item_type, capacity]}},
                    {"name": "len", "type": "u64"},
                ],
            },
        )

    def _bloom(self, cls: type[Bloom]) -> str:
        name = _BLOOM_NAMES.get(
            (cls.num_words, cls.num_keys), f"Bloom{cls.num_words}x{cls.num_keys}"
        )
        return self._register(
            name,
            {
                "kind": "struct",
                "fields": [
                    {"name": "keys", "type": {"array": ["u64", cls.num_keys]}},
                    {"name": "bits", "type": {"array": ["u64", cls.num_words]}},
                ],
            },
        )


def _type_label(idl_type: Any) -> str:
    if isinstance(idl_type, str):
        return idl_type[0].upper() + idl_type[1:]
    if "defined" in idl_type:
        return str(idl_type["defined"])
    raise TypeError(f"no FixedVec name for item type {idl_type!r}")


def _instruction(spec: InstructionSpec, collector: _TypeCollector) -> dict[str, Any]:
    return {
        "name": spec.name,
        "accounts": [
            {"name": a.name, "isMut": a.writable, "isSigner": a.signer} for a in spec.accounts
        ],
        "args": collector.fields(spec.args),
    }


def generate_idl(program: str, ids: ProgramIds = DEFAULT_PROGRAM_IDS) -> dict[str, Any]:
    """The legacy-format IDL of one program ("coordinator", "authorizer" or "treasurer")."""
    collector = _TypeCollector()
    instructions = [_instruction(spec, collector) for spec in INSTRUCTIONS[program].values()]
    accounts = []
    for cls in _ACCOUNTS[program]:
        accounts.append(
            {
                "name": anchor_account_name(cls),
                "type": {"kind": "struct", "fields": collector.fields(cls)},
            }
        )
    account_names = {a["name"] for a in accounts}
    types = [
        {"name": name, "type": body}
        for name, body in sorted(collector.types.items())
        if name not in account_names
    ]
    return {
        "version": IDL_VERSION,
        "name": PROGRAM_NAMES[program],
        "instructions": instructions,
        "accounts": accounts,
        "types": types,
        "errors": [
            {"code": spec.code(i), "name": spec.name, "msg": spec.message}
            for i, spec in enumerate(_ERRORS[program])
        ],
        "metadata": {"address": getattr(ids, program)},
    }


def idl_json(program: str, ids: ProgramIds = DEFAULT_PROGRAM_IDS) -> str:
    return json.dumps(generate_idl(program, ids), indent=2) + "\n"


def idl_file_name(program: str) -> str:
    return f"{PROGRAM_NAMES[program]}.json"


def load_idl_text(program: str) -> str:
    """The committed IDL file of a program."""
    return (resources.files("psyche.solana") / "idl" / idl_file_name(program)).read_text()


def write_idl_files(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for program in PROGRAM_NAMES:
        path = directory / idl_file_name(program)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(idl_json(program))
        tmp.replace(path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--write"]:
        for path in write_idl_files(Path(__file__).parent / "idl"):
            print(f"wrote {path}")
        return 0
    if args == ["--check"]:
        stale = [
            program for program in PROGRAM_NAMES if load_idl_text(program) != idl_json(program)
        ]
        if stale:
            print(f"stale IDL files: {stale}; run `python -m psyche.solana.idl --write`")
            return 1
        print("IDL files are up to date")
        return 0
    print("usage: python -m psyche.solana.idl --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
