"""What `psyche-server run` and `psyche-server relay` take (upstream's `RunArgs` in
architectures/centralized/server/src/main.rs), declared once: each field is a flag
(`--field-name`), its environment variable (`FIELD_NAME`) and its `--help` text
(`psyche.core.cli.env_option`). `psyche.cli.server` puts them on its parser and builds them back;
research code builds them directly and calls `psyche.centralized.run.run_server` (or
`psyche.centralized.standalone_relay.run_relay`).

Each component takes its own settings, built from these: the server `ServerOptions`
(`psyche.centralized.run.server_options`), the trackers `TrackerConfig` (`tracker_config`), the
relay `RelayOptions` (`relay_options`). This module imports nothing heavy, so `--help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psyche.core.cli import env_option, parse_bool, parse_unsigned

if TYPE_CHECKING:
    from psyche.metrics import TrackerConfig
    from psyche.network import RelayOptions

EVERY_INTERFACE = "0.0.0.0"
DEFAULT_BAN_EPOCHS = 1  # psyche.coordinator.server_core's (not imported: --help stays light)


def switch_option(default: bool, *, help: str) -> Any:
    """A true/false option: `--flag` alone means true, `--flag false` false."""
    return env_option(default, parse=parse_bool, optional_value=True, help=help)


def relay_port_option() -> Any:
    return env_option(
        None,
        parse=parse_unsigned(16),
        help="Port of the relay (a random free port if not specified)",
    )


def announce_address_option(what: str) -> Any:
    return env_option(
        None,
        metavar="<ADDRESS>",
        help=f"{what} (default: --bind-address, or the address of the default route when that "
        "is 0.0.0.0)",
    )


@dataclass(frozen=True, kw_only=True)
class ServerRunOptions:
    """`psyche-server run`: serve the run in `state` until SIGINT or SIGTERM (or its end)."""

    state: Path = env_option(
        parse=Path,
        required=True,
        metavar="<STATE>",
        help="Path to TOML of Coordinator state, or a save-state directory to resume from",
    )
    server_port: int | None = env_option(
        None,
        short="-s",
        parse=parse_unsigned(16),
        help="Port for the server, which clients will use to connect. if not specified, a "
        "random free port will be chosen.",
    )
    bind_address: str = env_option(
        EVERY_INTERFACE,
        metavar="<ADDRESS>",
        help="Address the coordinator and its data server listen on (0.0.0.0: every "
        "interface, as upstream; 127.0.0.1: this machine only)",
    )
    authorized_keys: Path | None = env_option(
        None,
        parse=Path,
        metavar="<FILE>",
        help="Make the run private: only the ed25519 public keys in FILE (64 hex digits each, "
        "one a line, # comments) may connect and join. Without it anyone with the run id may "
        "join",
    )
    ban_epochs: int = env_option(
        DEFAULT_BAN_EPOCHS,
        parse=parse_unsigned(16),
        metavar="<EPOCHS>",
        help="Epochs a member sits out after being dropped for not delivering (its training "
        "missing at a health check, or elected witness of a round that ended without a "
        "witness); twice its last ban when it does so again soon after one (up to 64); 0 "
        "re-admits it at once, as upstream",
    )
    tui: bool = switch_option(
        True,
        help="Show the live dashboard (Ctrl+P pauses/resumes); false logs plainly",
    )
    relay: bool = switch_option(
        True,
        help="Host a circuit relay for the run's clients, so that clients behind NAT reach "
        "each other through it (only clients connected to this server may use it)",
    )
    relay_port: int | None = relay_port_option()
    relay_announce_address: str | None = announce_address_option(
        "Address clients dial for the relay"
    )
    data_config: Path | None = env_option(
        None, parse=Path, help="Path to TOML of data server config"
    )
    save_state_dir: Path | None = env_option(
        None,
        parse=Path,
        help="Path to save the server and coordinator state (at each epoch end and on exit)",
    )
    events_dir: Path | None = env_option(
        None,
        parse=Path,
        help="Directory to write event files for the observer. Coordinator state changes are "
        "appended to {events_dir}/coordinator/state.bin (format: docs/centralized.md)",
    )
    init_warmup_time: int | None = env_option(
        None,
        parse=parse_unsigned(64),
        help="Sets the warmup time for the run. This overrides the warmup_time declared in "
        "the state file.",
    )
    withdraw_on_disconnect: bool = switch_option(
        True,
        help="Automatically withdraw clients that disconnect from the server",
    )
    oltp_auth_header: str | None = env_option(
        None, help="An auth header string for an opentelemetry endpoint"
    )
    oltp_metrics_url: str | None = env_option(
        None, help="A URL for sending opentelemetry metrics (OTLP/HTTP)"
    )
    oltp_tracing_url: str | None = env_option(
        None, help="A URL for sending opentelemetry traces (OTLP/HTTP)"
    )
    oltp_logs_url: str | None = env_option(
        None, help="A URL for sending opentelemetry logs (OTLP/HTTP)"
    )
    oltp_report_interval: float = env_option(
        60.0,
        parse=float,
        metavar="<SECONDS>",
        help="Seconds between two OpenTelemetry metric exports",
    )
    metrics_jsonl: Path | None = env_option(
        None,
        parse=Path,
        metavar="<FILE>",
        help="Append the run's state, membership and round durations to FILE, one JSON object "
        "a line (logged whenever they change)",
    )
    status_port: int | None = env_option(
        None,
        parse=parse_unsigned(16),
        metavar="<PORT>",
        help="Serve a read-only status page on this port: / (HTML) and /status.json (run "
        "state, members and their health, round durations, the loss curve clients report). "
        "Off unless given; 0 picks a free port",
    )
    status_bind_address: str = env_option(
        "127.0.0.1",
        metavar="<ADDRESS>",
        help="Address the status page listens on (this machine only unless told otherwise)",
    )

    def tracker_config(self) -> TrackerConfig:
        """The trackers' settings (`--oltp-*`, `--metrics-jsonl`)."""
        from psyche.metrics import TrackerConfig

        return TrackerConfig.from_options(self)


@dataclass(frozen=True, kw_only=True)
class StandaloneRelayOptions:
    """`psyche-server relay`: only the circuit relay, for runs without a centralized server."""

    bind_address: str = env_option(
        EVERY_INTERFACE,
        metavar="<ADDRESS>",
        help="Address the relay listens on (0.0.0.0: every interface)",
    )
    relay_port: int | None = relay_port_option()
    relay_announce_address: str | None = announce_address_option("Address clients dial")
    identity_secret_key_path: Path | None = env_option(
        None,
        parse=Path,
        metavar="<FILE>",
        help="The relay's 32-byte secret key (`openssl rand 32 > relay.key`); its address "
        "names the key, so keep one to keep the address (random if not given)",
    )
    authorized_keys: Path | None = env_option(
        None,
        parse=Path,
        metavar="<FILE>",
        help="The run's members: ed25519 public keys, 64 hex digits a line, # comments",
    )
    open: bool = switch_option(
        False,
        help="Serve any peer (an open run); its caps still bound what each can hold",
    )
    max_reservations: int = env_option(
        1024,
        parse=parse_unsigned(32),
        metavar="<N>",
        help="Peers that may hold a slot at once",
    )

    def relay_options(self) -> RelayOptions:
        """The relay's own settings."""
        from psyche.network import RelayOptions

        return RelayOptions(
            bind_host=self.bind_address,
            port=self.relay_port or 0,
            announce_host=self.relay_announce_address,
            max_reservations=self.max_reservations,
        )


__all__ = ["ServerRunOptions", "StandaloneRelayOptions"]
