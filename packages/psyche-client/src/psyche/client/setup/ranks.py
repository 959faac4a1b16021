"""The client's ranks as its options give them (`--data-parallelism`, `--tensor-parallelism`,
`--fsdp` and its dtypes, `--activation-checkpointing`, `--device`, `--cpu-threads`, and for a
client across hosts `--main-host`, `--sidecar-port`, `--num-local-ranks`): the settings
`workers.WorkerGroup` takes, and what is wrong with them; and the ranks a `psyche-client
sidecar` runs on another host (`SidecarLayout`, upstream psyche-sidecar's `--main-host`,
`--port`, `--world-size`, `--start-rank`, `--num-local-ranks`).

This module imports nothing heavy (`TrainOptions` composes it, and `--help` must stay fast):
torch is imported only by `sharding`, when the ranks are laid out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psyche.modeling.sharding import ShardingOptions


DEFAULT_PORT = 34567
"""The TCP store's port on the main host (upstream's `--sidecar-port` / psyche-sidecar's
`--port` default)."""

SHARED_FIELDS = (
    "dp",
    "tp",
    "fsdp",
    "param_dtype",
    "reduce_dtype",
    "activation_checkpointing",
    "fused_loss",
)

FUSED_LOSS_CHOICES = ("off", "auto", "chunked", "liger")
"""`--fused-loss` (`psyche.modeling.fused_loss.FUSED_LOSS_CHOICES`, which imports torch)."""
"""What every rank of a client must agree on; the leader publishes them to other hosts."""


@dataclass(frozen=True)
class RankLayout:
    """The client's ranks: `dp` data parallel x `tp` tensor parallel, one device each.

    With `main_host`, the ranks meet on a TCP store at `main_host:port` instead of a private
    file, so ranks on other hosts (a `psyche-client sidecar` each) can join: this host runs
    ranks `start_rank .. start_rank + ranks_here - 1` (the leader: 0 .. `local_ranks` - 1)."""

    dp: int = 1
    tp: int = 1
    fsdp: bool = False
    device: str = "auto"
    cpu_threads: int | None = None
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    activation_checkpointing: bool = False
    fused_loss: str = "off"
    main_host: str | None = None
    port: int = DEFAULT_PORT
    local_ranks: int | None = None
    start_rank: int = 0
    eval_replica: bool = False
    """Keep a whole replica of the model on rank 0 for evaluations when rank 0 holds only part
    of it (TP, FSDP; `LeaderTrainer.keep_replica`): set when evaluations are asked for."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def whole_on_rank_0(self) -> bool:
        """Whether rank 0 holds the whole model (replicated data parallelism or one rank): then
        it evaluates alone between rounds (a forward pass needs no other rank), as a one-rank
        client does, on the same bits every rank holds. Otherwise it evaluates on a gathered
        replica (`eval_replica`)."""
        return self.tp == 1 and not self.fsdp

    @property
    def keeps_replica(self) -> bool:
        """Whether rank 0 keeps a gathered whole replica for evaluations."""
        return self.eval_replica and not self.whole_on_rank_0 and self.start_rank == 0

    @property
    def ranks_here(self) -> int:
        """The ranks this host runs (all of them without `main_host`)."""
        return self.world_size if self.local_ranks is None else self.local_ranks

    @property
    def remote_ranks(self) -> range:
        """The leader's view: the ranks that run on other hosts."""
        return range(self.ranks_here, self.world_size) if self.start_rank == 0 else range(0)

    def shared(self) -> dict[str, Any]:
        """The fields every rank must agree on (published to other hosts as JSON)."""
        return {k: v for k, v in asdict(self).items() if k in SHARED_FIELDS}

    def joining(self, shared: dict[str, Any], sidecar: SidecarLayout) -> RankLayout:
        """The layout of a sidecar's ranks: the leader's `shared` fields, this host's own."""
        return replace(
            self,
            **{k: shared[k] for k in SHARED_FIELDS},
            main_host=sidecar.main_host,
            port=sidecar.port,
            local_ranks=sidecar.num_local_ranks,
            start_rank=sidecar.start_rank,
        )

    @property
    def needed(self) -> bool:
        """Whether the trainer is built through a `WorkerGroup` (several ranks, or a memory
        option the one-rank path applies the same way)."""
        return self.world_size > 1 or self.activation_checkpointing or self.fused_loss != "off"

    def sharding(self) -> ShardingOptions:
        import torch

        from psyche.modeling.sharding import ShardingOptions

        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        return ShardingOptions(
            param_dtype=dtypes.get(self.param_dtype),
            reduce_dtype=dtypes[self.reduce_dtype],
            activation_checkpointing=self.activation_checkpointing,
        )

    def problems(self) -> list[str]:
        """What is wrong with the layout and its device, as one-line messages (checked before
        anything heavy loads; devices that do not exist are found when the ranks start)."""
        problems = []
        dp, tp, world = self.dp, self.tp, self.world_size
        device = self.device.strip().lower()
        if device.startswith("cuda:"):
            parts = device[5:].split(",")
            if not all(p.strip().isdigit() for p in parts):
                problems.append(f"--device {self.device}: expected cuda:N or cuda:N,M,...")
            elif self.local_ranks is not None and len(parts) != self.local_ranks:
                problems.append(
                    f"--device {self.device} names {len(parts)} device(s) for "
                    f"--num-local-ranks {self.local_ranks}: list {self.local_ranks} devices, "
                    "or use --device cuda / auto"
                )
            elif self.local_ranks is None and len(parts) != world:
                problems.append(
                    f"--device {self.device} names {len(parts)} device(s) for "
                    f"--data-parallelism {dp} x --tensor-parallelism {tp} = {world} rank(s): "
                    f"list {world} devices, or use --device cuda / auto"
                )
            elif len(set(map(int, parts))) != len(parts):
                problems.append(f"--device {self.device}: a device is listed twice")
        elif device not in ("auto", "cpu", "cuda"):
            problems.append(
                f"--device {self.device}: supported are auto, cpu, cuda, cuda:N and "
                "cuda:N,M,... (one per rank)"
            )
        if self.fsdp and dp < 2:
            problems.append("--fsdp shards over the data-parallel ranks: add --data-parallelism 2+")
        if not self.fsdp and (self.param_dtype != "auto" or self.reduce_dtype != "fp32"):
            problems.append("--param-dtype and --reduce-dtype apply to --fsdp only")
        if self.main_host is None and self.local_ranks is not None:
            problems.append(
                "--num-local-ranks needs --main-host (the ranks of other hosts meet there)"
            )
        if self.local_ranks is not None and self.local_ranks > world:
            problems.append(
                f"--num-local-ranks {self.local_ranks} exceeds --data-parallelism {dp} x "
                f"--tensor-parallelism {tp} = {world} rank(s)"
            )
        return problems


@dataclass(frozen=True)
class SidecarLayout:
    """`psyche-client sidecar`: ranks `start_rank .. start_rank + num_local_ranks - 1` of the
    client whose leader listens at `main_host:port` (its layout comes from the leader)."""

    main_host: str
    world_size: int
    start_rank: int
    num_local_ranks: int = 1
    port: int = DEFAULT_PORT
    device: str = "auto"
    cpu_threads: int | None = None

    def problems(self) -> list[str]:
        problems = []
        if self.start_rank < 1:
            problems.append("--start-rank must be at least 1 (rank 0 is the client itself)")
        last = self.start_rank + self.num_local_ranks - 1
        if last >= self.world_size:
            problems.append(
                f"--start-rank {self.start_rank} + --num-local-ranks {self.num_local_ranks} "
                f"runs ranks up to {last}, beyond --world-size {self.world_size}"
            )
        return problems

    def layout(self) -> RankLayout:
        """This host's part, before the leader's shared fields are known (`RankLayout.joining`)."""
        return RankLayout(device=self.device, cpu_threads=self.cpu_threads)


__all__ = ["DEFAULT_PORT", "FUSED_LOSS_CHOICES", "RankLayout", "SidecarLayout"]
