"""``python -m relay``: the same as the ``outbox-relay`` command."""

from relay.cli import main

main()
