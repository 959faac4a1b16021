"""A hostile run member as a real process, for the end-to-end tests only (never a command):

    python tests/e2e/hostile_client.py ATTACK START -- <psyche-client train arguments>

runs `psyche-client train` with every trainer it builds turned hostile
(`psyche.modeling.hostile.make_hostile`): from its `START`th result on, it commits to and sends
what `ATTACK` (`sign-flip`, `scaled`, ...) makes of its honest results. Its payloads hash to
their commitments and pass every check of their bytes: only the witnesses' checks can tell.
"""

from __future__ import annotations

import sys

from psyche.modeling import trainer as trainer_module
from psyche.modeling.hostile import Attack, HostileMember, make_hostile


def main() -> None:
    attack, start, separator, *client_args = sys.argv[1:]
    assert separator == "--", "usage: hostile_client.py ATTACK START -- <train arguments>"
    honest_init = trainer_module.Trainer.__init__

    def hostile_init(self: trainer_module.Trainer, *args: object, **kwargs: object) -> None:
        honest_init(self, *args, **kwargs)  # type: ignore[arg-type]
        make_hostile(self, HostileMember(Attack(attack), seed=7, start=int(start)))

    trainer_module.Trainer.__init__ = hostile_init  # type: ignore[method-assign]
    from psyche.cli.client.main import main as client_main

    sys.exit(client_main(client_args))


if __name__ == "__main__":
    main()
