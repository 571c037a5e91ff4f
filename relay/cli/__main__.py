"""``python -m relay.cli``: the same as the ``outbox-relay`` command."""

from relay.cli import main

main()
