"""The committed IDL files against the encoders, through anchorpy (an independent borsh codec).

For every instruction of the three programs: our encoder's bytes are parsed by anchorpy from the
IDL, anchorpy must consume exactly those bytes and read back the same values. So the IDL and
the encoders cannot drift apart.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from anchorpy import Coder
from pyheck import snake
from solders.pubkey import Pubkey

from psyche.coordinator import (
    CoordinatorProgress,
    Witness,
    WitnessEvalResult,
    WitnessMetadata,
)
from psyche.coordinator.committee_selection import Committee, WitnessProof
from psyche.coordinator.config import CoordinatorConfig
from psyche.coordinator.model import (
    LLM,
    Checkpoint,
    Gcp,
    GcsRepo,
    HttpLLMTrainingDataLocation,
    HttpTrainingDataLocation,
    HubRepo,
    LLMArchitecture,
    LLMTrainingDataLocation,
    LLMTrainingDataType,
    Model,
)
from psyche.coordinator.verification import (
    Finding,
    RoundDuties,
    RoundVerification,
    VerificationDuty,
)
from psyche.core.batch_id import BatchId
from psyche.core.bloom import WitnessBloom
from psyche.core.data_shuffle import Shuffle
from psyche.core.definitions import (
    Distro,
    LearningRateSchedule,
    OptimizerDefinition,
    WarmupStableDecayLR,
)
from psyche.core.merkle_tree import MerkleRoot
from psyche.core.node_identity import NodeIdentity
from psyche.core.serde import DataEnum, RustEnum
from psyche.core.token_size import TokenSize
from psyche.solana.borsh import fixed_str_bytes
from psyche.solana.idl import (
    PROGRAM_NAMES,
    generate_idl,
    idl_json,
    load_idl_text,
)
from psyche.solana.instructions import INSTRUCTIONS
from psyche.solana.instructions import authorizer as authorizer_ix
from psyche.solana.instructions import coordinator as coordinator_ix
from psyche.solana.instructions import treasurer as treasurer_ix
from psyche.solana.state import (
    Authorization,
    CoordinatorInstance,
    Participant,
    RunMetadata,
    TreasurerRun,
    encode_anchor_account,
)
from psyche.solana.verification import (
    BanRecord,
    RunVerification,
    VerificationEntry,
    VerifiedRound,
)

from .anchorpy_idl import load_anchorpy_idl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:sumtypes")


def _key(n: int) -> bytes:
    return bytes([n]) * 32


IDENTITY = NodeIdentity(_key(7), _key(8))
MODEL = Model.LLM(
    LLM(
        max_seq_len=2048,
        cold_start_warmup_steps=10,
        architecture=LLMArchitecture.HfDeepseek,
        checkpoint=Checkpoint.P2P(HubRepo("org/model", "rev")),
        data_type=LLMTrainingDataType.Finetuning,
        data_location=LLMTrainingDataLocation.Http(
            HttpLLMTrainingDataLocation(
                HttpTrainingDataLocation.Gcp(Gcp("bucket", "dir")),
                TokenSize.FourBytes,
                Shuffle.Seeded(bytes(range(32))),
            )
        ),
        lr_schedule=LearningRateSchedule.WarmupStableDecay(
            WarmupStableDecayLR(1e-4, 0.0, 1e-5, 1e-6, 10, 20, 30, 40)
        ),
        optimizer=OptimizerDefinition.Distro(
            Distro(
                clip_grad_norm=1.0,
                weight_decay=None,
                compression_decay=0.995,
                compression_topk=4,
                compression_chunk=64,
                quantize_1bit=True,
            )
        ),
    )
)
CONFIG = CoordinatorConfig(15, 30, 15, 1, 99, 60, 25000, 2, 1, 1, 8, 16, 10, 3)
WITNESS = Witness(
    WitnessProof(3, 1, True),
    WitnessBloom(list(range(8)), list(range(16))),
    WitnessBloom(list(range(8, 16)), list(range(16, 32))),
    MerkleRoot(_key(9)),
)
METADATA = WitnessMetadata(
    step=4,
    tokens_per_sec=1.5,
    loss=3.25,
    evals=[WitnessEvalResult("arc", 0.5)],
    prompt_results=[1, -1],
    prompt_index=2,
    efficency=0.75,
)

DUTY = VerificationDuty(BatchId(4, 7), IDENTITY, IDENTITY)
SAMPLES: dict[str, Any] = {
    "init_coordinator": coordinator_ix.InitCoordinatorArgs(
        coordinator_ix.InitCoordinatorParams(_key(1), _key(2), "run", "v1")
    ),
    "free_coordinator": coordinator_ix.FreeCoordinatorArgs(),
    "update": coordinator_ix.UpdateArgs(
        metadata=RunMetadata("name", "desc", 10, 20),
        config=CONFIG,
        model=MODEL,
        progress=CoordinatorProgress(1, 2, 3),
    ),
    "update_client_version": coordinator_ix.UpdateClientVersionArgs("v2"),
    "set_future_epoch_rates": coordinator_ix.SetFutureEpochRatesArgs(5, None),
    "join_run": coordinator_ix.JoinRunArgs(coordinator_ix.JoinRunParams(IDENTITY)),
    "set_paused": coordinator_ix.SetPausedArgs(True),
    "tick": coordinator_ix.TickArgs(),
    "witness": coordinator_ix.WitnessArgs.from_witness(WITNESS, METADATA),
    "warmup_witness": coordinator_ix.WarmupWitnessArgs.from_witness(WITNESS),
    "health_check": coordinator_ix.HealthCheckArgs(IDENTITY, Committee.Trainer, 4, 2),
    "checkpoint": coordinator_ix.CheckpointArgs(Checkpoint.Gcs(GcsRepo("bucket", "prefix"))),
    "init_verification": coordinator_ix.InitVerificationArgs(),
    "verification_report": coordinator_ix.VerificationReportArgs(
        7, [Finding(BatchId(4, 7), False, 12.5), Finding(BatchId(8, 9), True, 0.25)]
    ),
    "set_verifiers_train": coordinator_ix.SetVerifiersTrainArgs(True),
    "set_exact_verification_threads": coordinator_ix.SetExactVerificationThreadsArgs(2),
    "authorization_create": authorizer_ix.AuthorizationCreateArgs(
        authorizer_ix.AuthorizationCreateParams(_key(3), b"CoordinatorJoinRun")
    ),
    "authorization_grantor_update": authorizer_ix.AuthorizationGrantorUpdateArgs(
        authorizer_ix.AuthorizationGrantorUpdateParams(True)
    ),
    "authorization_grantee_update": authorizer_ix.AuthorizationGranteeUpdateArgs(
        authorizer_ix.AuthorizationGranteeUpdateParams(True, [_key(4), _key(5)])
    ),
    "authorization_close": authorizer_ix.AuthorizationCloseArgs(),
    "run_create": treasurer_ix.RunCreateArgs(
        treasurer_ix.RunCreateParams(41, "run", "v1", _key(1), _key(2))
    ),
    "run_update": treasurer_ix.RunUpdateArgs(
        treasurer_ix.RunUpdateParams(
            config=CONFIG,
            model=MODEL,
            epoch_earning_rate_total_shared=7,
            paused=False,
            client_version="v3",
        )
    ),
    "run_set_verifiers_train": treasurer_ix.RunSetVerifiersTrainArgs(False),
    "run_set_exact_verification_threads": treasurer_ix.RunSetExactVerificationThreadsArgs(1),
    "participant_create": treasurer_ix.ParticipantCreateArgs(),
    "participant_claim": treasurer_ix.ParticipantClaimArgs(treasurer_ix.ParticipantClaimParams(12)),
}


def _typedefs(idl: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t["type"] for t in idl["types"] + idl["accounts"]}


def _get(value: Any, name: str) -> Any:
    if isinstance(value, dict):
        return value[snake(name)] if snake(name) in value else value[name]
    return getattr(value, snake(name))


def plain_ours(value: Any, t: Any, types: dict[str, Any]) -> Any:
    """Our Python value, shaped as the IDL type says."""
    if isinstance(t, str):
        if t == "publicKey":
            return bytes(value)
        if t == "bytes":
            return bytes(value)
        if isinstance(value, bool) and t != "bool":
            return int(value)
        return value
    if "option" in t:
        return None if value is None else plain_ours(value, t["option"], types)
    if "vec" in t:
        return [plain_ours(x, t["vec"], types) for x in value]
    if "array" in t:
        item, length = t["array"]
        if isinstance(value, str):
            return list(fixed_str_bytes(value, length))
        if isinstance(value, bytes):
            return list(value)
        return [plain_ours(x, item, types) for x in value]
    name = t["defined"]
    body = types[name]
    if body["kind"] == "struct":
        fields = body["fields"]
        if name.startswith("FixedVec"):
            item = fields[0]["type"]["array"][0]
            return [plain_ours(x, item, types) for x in value]
        if name == "WitnessBloom":
            return {"keys": list(value.keys), "bits": list(value.words)}
        return {f["name"]: plain_ours(getattr(value, f["name"]), f["type"], types) for f in fields}
    if isinstance(value, RustEnum):
        return {"variant": value.name}
    assert isinstance(value, DataEnum)
    variant = next(v for v in body["variants"] if v["name"] == type(value).variant_name)
    return plain_variant(
        variant,
        lambda f: plain_ours(getattr(value.value, f["name"]), f["type"], types),
        lambda t: plain_ours(value.value, t, types),
    )


def plain_anchorpy(value: Any, t: Any, types: dict[str, Any]) -> Any:
    """What anchorpy decoded, shaped the same way."""
    if isinstance(t, str):
        if t in ("publicKey", "bytes"):
            return bytes(value)
        return value
    if "option" in t:
        return None if value is None else plain_anchorpy(value, t["option"], types)
    if "vec" in t:
        return [plain_anchorpy(x, t["vec"], types) for x in value]
    if "array" in t:
        return [plain_anchorpy(x, t["array"][0], types) for x in value]
    name = t["defined"]
    body = types[name]
    if body["kind"] == "struct":
        fields = body["fields"]
        if name.startswith("FixedVec"):
            item = fields[0]["type"]["array"][0]
            data, length = _get(value, "data"), _get(value, "len")
            return [plain_anchorpy(x, item, types) for x in list(data)[:length]]
        return {f["name"]: plain_anchorpy(_get(value, f["name"]), f["type"], types) for f in fields}
    variant = next(v for v in body["variants"] if v["name"] == type(value).__name__)
    return plain_variant(
        variant,
        lambda f: plain_anchorpy(_get(value, f["name"]), f["type"], types),
        lambda t: plain_anchorpy(value.tuple_data[0], t, types),
    )


def plain_variant(
    variant: dict[str, Any], named: Callable[[Any], Any], only: Callable[[Any], Any]
) -> dict[str, Any]:
    """An enum value as `{"variant", "fields"}`, whichever decoder read it: `named(field)` gives a
    named field's plain value, `only(type)` the plain value of a one-field tuple variant."""
    fields = variant.get("fields")
    if fields is None:
        return {"variant": variant["name"]}
    if isinstance(fields[0], dict) and "name" in fields[0]:
        return {"variant": variant["name"], "fields": {f["name"]: named(f) for f in fields}}
    return {"variant": variant["name"], "fields": [only(fields[0])]}


@pytest.mark.parametrize("program", list(PROGRAM_NAMES))
def test_committed_idl_is_up_to_date(program: str) -> None:
    assert load_idl_text(program) == idl_json(program), "run `python -m psyche.solana.idl --write`"


@pytest.mark.parametrize("program", list(PROGRAM_NAMES))
def test_idl_accounts_match_instruction_specs(program: str) -> None:
    idl = json.loads(load_idl_text(program))
    assert [i["name"] for i in idl["instructions"]] == list(INSTRUCTIONS[program])
    for entry in idl["instructions"]:
        spec = INSTRUCTIONS[program][entry["name"]]
        assert [(a["name"], a["isMut"], a["isSigner"]) for a in entry["accounts"]] == [
            (a.name, a.writable, a.signer) for a in spec.accounts
        ]


@pytest.mark.parametrize(
    ("program", "name"),
    [(p, n) for p, specs in INSTRUCTIONS.items() for n in specs],
)
def test_anchorpy_reads_our_instruction_bytes(program: str, name: str) -> None:
    idl = generate_idl(program)
    types = _typedefs(idl)
    coder = Coder(load_anchorpy_idl(program))
    spec = INSTRUCTIONS[program][name]
    args = SAMPLES[name]
    data = spec.encode(args)

    parsed = coder.instruction.parse(data)
    assert parsed.name == name
    # anchorpy's layout for the instruction consumes exactly our bytes...
    stream = io.BytesIO(data[8:])
    coder.instruction.ix_layout[name].parse_stream(stream)
    assert stream.tell() == len(data) - 8
    # ...and reads back the same values.
    entry = next(i for i in idl["instructions"] if i["name"] == name)
    for arg in entry["args"]:
        ours = plain_ours(getattr(args, arg["name"]), arg["type"], types)
        theirs = plain_anchorpy(parsed.data[arg["name"]], arg["type"], types)
        assert theirs == ours, arg["name"]


def test_anchorpy_builds_the_same_bytes() -> None:
    coder = Coder(load_anchorpy_idl("coordinator"))
    built = coder.instruction.encode(
        "init_coordinator",
        {
            "params": {
                "main_authority": Pubkey.from_bytes(_key(1)),
                "join_authority": Pubkey.from_bytes(_key(2)),
                "run_id": "run",
                "client_version": "v1",
            }
        },
    )
    assert built == INSTRUCTIONS["coordinator"]["init_coordinator"].encode(
        SAMPLES["init_coordinator"]
    )
    built = coder.instruction.encode(
        "set_future_epoch_rates",
        {"epoch_earning_rate_total_shared": 5, "epoch_slashing_rate_per_client": None},
    )
    assert built == INSTRUCTIONS["coordinator"]["set_future_epoch_rates"].encode(
        SAMPLES["set_future_epoch_rates"]
    )


@pytest.mark.parametrize(
    ("program", "value"),
    [
        ("coordinator", CoordinatorInstance(254, _key(1), _key(2), _key(3), "run")),
        (
            "coordinator",
            RunVerification(
                253,
                _key(4),
                [VerifiedRound.of(RoundVerification(RoundDuties(7, (DUTY,), (DUTY,))))],
                [BanRecord(_key(5), 2, 1)],
                [VerificationEntry(7, "punished", IDENTITY, BatchId(4, 7), credited=[IDENTITY])],
            ),
        ),
        ("authorizer", Authorization(3, _key(1), _key(2), b"scope", True, [_key(5)], 99)),
        ("treasurer", TreasurerRun(1, 41, _key(1), _key(2), _key(3), _key(4), _key(5), 6, 7)),
        ("treasurer", Participant(2, 3, 4)),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_anchorpy_decodes_our_accounts(program: str, value: Any) -> None:
    idl = generate_idl(program)
    types = _typedefs(idl)
    coder = Coder(load_anchorpy_idl(program))
    decoded = coder.accounts.decode(encode_anchor_account(value))
    name = {"TreasurerRun": "Run"}.get(type(value).__name__, type(value).__name__)
    t = {"defined": name}
    assert plain_anchorpy(decoded, t, types) == plain_ours(value, t, types)
