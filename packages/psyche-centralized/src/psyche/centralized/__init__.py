"""The centralized backend: a TCP coordinator server and the client side of its protocol.

Modules (import what you need; nothing heavy is imported here):

* `protocol`: the messages (upstream's, plus the port's appended extensions);
* `server`: the trio server (`open_server`), a shell around the server's rules
  (`psyche.coordinator.server_core.ServerCore`);
* `save_state`: the saved-state files; `events`: the `--events-dir` record file;
* `client`: `CentralizedBackend`, the `Backend` a training client talks to;
* `dashboard`: the server's terminal dashboard; `tiny_run`: the tiny CPU run's assets.

See docs/centralized.md.
"""
