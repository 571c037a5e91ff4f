"""The relay daemon: claims subscriber parts and runs one worker per claimed part.

Several relay processes may run against one database. Each holds a session
(:mod:`relay.sessions`); a supervisor thread spreads the parts over the live
sessions, claims its share, releases what a peer should own, and starts or stops
workers to match. The commit probe wakes the workers; they also poll on a timer.

:class:`Relay` (``lifecycle``) composes one object per concern: ``membership`` (the
session, held while Kafka answers), ``parts`` (claims and their workers),
``publishers`` (a Kafka publisher per part), ``upkeep`` (retention and horizon
warnings) and ``startup`` (schema check, subscriber sync, key-space checks).
:class:`RelayProcesses` (``processes``) runs several of them as member processes.
"""

from relay.daemon.lifecycle import Relay, start_with_retries, tune_gc
from relay.daemon.processes import RelayProcesses

__all__ = ["Relay", "RelayProcesses", "start_with_retries", "tune_gc"]
