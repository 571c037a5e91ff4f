"""A subscriber's definition, its rules held once (issue #48): ``subscribers add`` and
``set`` and the relay's start-up (the subscribers its config declares) all define a
subscriber with :func:`define`, check it against the relay's setup with :func:`check`,
and write it only once every check has passed.

- :func:`define`: options to a :class:`Subscriber`: the value format's default (Avro
  when writer schemas are loaded, else JSON) and the rules of the definition itself.
- :func:`check`: what the definition needs of the world: the writer schemas its
  format needs, the schema registry's compatibility rules, room on its topics for
  its partition field. A refusal is reported, never half-applied.
- :func:`add`, :func:`set_options`, :func:`sync`: the writes, each after the checks.
  A change is a :class:`Change` (before, after), what the ledger of interventions
  records; a change that would reset options the operator did not give, or narrow what
  the subscriber publishes, waits for ``yes``.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from relay.core.formats import default_format, format_of
from relay.core.interventions import Action, Actor, Intervention
from relay.core.log_fields import log_extra
from relay.core.ports import DefinitionStore, SubscriberState
from relay.core.redact import redact
from relay.core.schemas import SchemaFolder
from relay.core.settings import Settings
from relay.core.subscribers import (
    DEFAULT_SUBSCRIBER,
    PoisonPolicy,
    StartFrom,
    Subscriber,
    ValueFormat,
)
from relay.errors import (
    BrokerUnavailable,
    ConfigError,
    NotMigratedError,
    SchemaIncompatible,
    SchemaRegistryUnavailable,
    SubscriberError,
)
from relay.ops import interventions
from relay.ops.lag import Lag, subscriber_lag

logger = logging.getLogger(__name__)

# Who acts when a caller does not say (a test, a script): the ledger still has the
# database role.
_NO_ONE = Actor()


# -- what a definition is checked against ---------------------------------------------


def load_schemas(settings: Settings) -> SchemaFolder | None:
    """The configured writer schemas; a configured folder that is missing is an error
    now, not a halt at the first event."""
    folder = settings.schemas_dir
    if folder is None:
        return None
    if not folder.is_dir():
        raise ConfigError(
            f"schemas_dir: {str(folder)!r} is not a folder (from the config file, "
            "RELAY_SCHEMAS_DIR or --schemas-dir); point it at your .avsc files, or unset it "
            "to publish JSON"
        )
    return SchemaFolder.from_dir(folder)


class Compatibility(Protocol):
    """What the schema registry's check of a subscriber's schemas found: a line per
    (subject, schema) checked, and what only the first publish can check."""

    @property
    def checked(self) -> list[str]: ...

    @property
    def unchecked(self) -> list[str]: ...


# The registry's check of a subscriber's writer schemas against its compatibility
# rules: raises SchemaIncompatible (every refusal), or SchemaRegistryUnavailable.
RegistryCheck = Callable[[SchemaFolder, Subscriber], Compatibility]
# The first subscriber whose topics lack partitions its partition field ranges over,
# and why; raises BrokerUnavailable, or ConfigError without bootstrap_servers.
PartitionRoom = Callable[[Settings, Sequence[Subscriber]], tuple[str, str] | None]


@dataclass(frozen=True)
class Setup:
    """What a definition is checked against: the settings, the writer schemas loaded,
    and what the world is asked, both from the composition root (relay.wiring's
    ``registry_check`` and ``partition_room``): the schema registry's check (None when
    no registry is configured) and the broker's partitions (None: not checked)."""

    settings: Settings
    schemas: SchemaFolder | None = None
    registry: RegistryCheck | None = None
    partition_room: PartitionRoom | None = None

    @property
    def default_format(self) -> ValueFormat:
        """A subscriber that names no format: Avro only when there are writer schemas."""
        return default_format(has_schemas=self.schemas is not None)


# -- define ------------------------------------------------------------------------


def define(setup: Setup, options: Mapping[str, Any]) -> Subscriber:
    """A subscriber from its options (a stored definition's, the config's, the command
    line's: a field missing or None takes its default, the value format
    ``setup.default_format``). Refused (SubscriberError, ConfigError) when it
    contradicts itself; what it needs of the world is :func:`check`'s."""
    fields = dict(options)
    if fields.get("value_format") is None:
        fields["value_format"] = setup.default_format
    policy = PoisonPolicy(fields.get("on_poison") or PoisonPolicy.HALT)
    if fields.get("dead_letter_topic") is not None and policy is not PoisonPolicy.DEAD_LETTER:
        # The topic would be ignored and poison halt the part.
        raise ConfigError(
            f"subscriber {fields.get('name')!r}: a dead-letter topic is used only with "
            '--on-poison dead-letter (on_poison = "dead-letter"); add it, or drop the '
            "dead-letter topic (--dead-letter-topic; `subscribers set --unset "
            "dead-letter-topic`)"
        )
    return Subscriber.from_dict(fields)


# -- check -------------------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    subscriber: str
    error: ConfigError


@dataclass
class Report:
    """What :func:`check` found: lines checked, lines only the first publish can check,
    warnings (what could not be checked now), and refusals."""

    checked: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)

    def refuse(self, fix: Callable[[str], str] | None = None) -> None:
        """Raise the refusals, if any, as one error (SchemaIncompatible when each is the
        registry's, else ConfigError); ``fix`` adds a line per refused subscriber."""
        if not self.refusals:
            return
        lines = [
            str(r.error) + ("" if fix is None else f"\n{fix(r.subscriber)}") for r in self.refusals
        ]
        registry_only = all(isinstance(r.error, SchemaIncompatible) for r in self.refusals)
        kind = SchemaIncompatible if registry_only else ConfigError
        raise kind("\n".join(lines)) from self.refusals[0].error


def check(
    setup: Setup, subscribers: Sequence[Subscriber], *, broker_required: bool = True
) -> Report:
    """Check ``subscribers`` against ``setup``: their format's needs, their schemas
    against the registry's compatibility rules, their topics' partitions against
    their partition field. A registry that cannot answer is a warning (the relay
    checks again when it registers); a broker that cannot is a refusal when
    ``broker_required``, else a warning (each record's partition is checked as it is
    published)."""
    report = Report()
    formats_ok = []
    for subscriber in subscribers:
        refused = _format_refusal(setup, subscriber)
        if refused is None:
            formats_ok.append(subscriber)
        else:
            report.refusals.append(Refusal(subscriber.name, refused))
    _check_registry(setup, formats_ok, report)
    _check_partitions(setup, formats_ok, report, broker_required=broker_required)
    return report


def _format_refusal(setup: Setup, subscriber: Subscriber) -> ConfigError | None:
    """A format whose needs are not configured would fail every event: refused, naming
    the keys (the format says what it needs)."""
    value_format = format_of(subscriber.value_format)
    refused = value_format.refusal(subscriber.name, setup.settings, setup.schemas is not None)
    return None if refused is None else ConfigError(refused)


def _check_registry(setup: Setup, subscribers: Sequence[Subscriber], report: Report) -> None:
    """Each avro-registry subscriber's schemas against the registry's rules (docs/design.md,
    "Schema registry")."""
    wanting = [s for s in subscribers if format_of(s.value_format).registry]
    if not wanting or setup.registry is None or setup.schemas is None:
        return  # without them, _format_refusal has refused it
    for subscriber in wanting:
        try:
            found = setup.registry(setup.schemas, subscriber)
        except SchemaRegistryUnavailable as exc:
            # Not once per subscriber: each would wait for the client's timeouts.
            report.warnings.append(
                f"schemas not checked against the registry (from subscriber "
                f"{subscriber.name!r} on): {redact(str(exc))}"
            )
            return
        except SchemaIncompatible as exc:
            report.refusals.append(Refusal(subscriber.name, exc))
            continue
        report.checked.extend(f"schema registry: {line}" for line in found.checked)
        report.unchecked.extend(
            f"schema registry: not checked before the first publish: {line}"
            for line in found.unchecked
        )


def _check_partitions(
    setup: Setup, subscribers: Sequence[Subscriber], report: Report, *, broker_required: bool
) -> None:
    """A partition field whose range the subscriber's topics do not have: each row
    naming a partition beyond would be poison."""
    if all(s.partition_count is None for s in subscribers):
        return
    why = "--partition-by: the partitions of the subscriber's topics must be checked"
    if setup.partition_room is None:  # a setup without the broker's side (a test's)
        _unchecked(report, subscribers, f"{why}, which needs the broker", broker_required)
        return
    try:
        refusal = setup.partition_room(setup.settings, subscribers)
    except ConfigError as exc:  # no bootstrap_servers
        _unchecked(report, subscribers, f"{why}, which needs the broker: {exc}", broker_required)
        return
    except BrokerUnavailable as exc:
        problem = f"{why}, and the broker does not answer: {redact(str(exc))}"
        _unchecked(report, subscribers, problem, broker_required)
        return
    if refusal is not None:
        name, problem = refusal
        report.refusals.append(Refusal(name, ConfigError(f"subscriber {name!r}: {problem}")))


def _unchecked(
    report: Report, subscribers: Sequence[Subscriber], problem: str, refused: bool
) -> None:
    if refused:
        name = next(s.name for s in subscribers if s.partition_count is not None)
        report.refusals.append(Refusal(name, ConfigError(problem)))
    else:
        report.warnings.append(problem)


# -- changes -------------------------------------------------------------------------

_FILTERS = ("aggregate_types", "event_types")
_SHOWN_AS_NONE = {
    "aggregate_types": "(all)",
    "event_types": "(all)",
    "dead_letter_topic": "(default)",
}


@dataclass(frozen=True)
class Difference:
    """One field of a definition, before and after."""

    field: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.field}: {self._shown(self.before)} → {self._shown(self.after)}"

    def _shown(self, value: Any) -> str:
        if isinstance(value, list):
            value = ",".join(value) or None
        return _SHOWN_AS_NONE.get(self.field, "(none)") if value is None else str(value)


@dataclass(frozen=True)
class Change:
    """A subscriber's definition before and after a change (``before`` None: created),
    as the ledger of interventions records it."""

    before: Subscriber | None
    after: Subscriber
    start: StartFrom = StartFrom.BEGINNING

    @property
    def differences(self) -> list[Difference]:
        """The fields that change (not the name, nor ``paused``: no definition's)."""
        if self.before is None:
            return []
        old, new = self.before.as_dict(), self.after.as_dict()
        return [
            Difference(k, old[k], new[k])
            for k in old
            if k not in ("name", "paused") and old[k] != new[k]
        ]

    @property
    def changed(self) -> bool:
        return self.before is None or bool(self.differences)

    @property
    def narrowed(self) -> list[str]:
        """The filters that no longer take every kind of event they took: those
        events, waiting or to come, are not published by this subscriber."""
        return [f for f in _FILTERS if self.before and _narrows(*self._filter(f))]

    @property
    def widened(self) -> list[str]:
        """The filters that take kinds of event they did not: those after the
        checkpoint are published, those before it are not."""
        return [f for f in _FILTERS if self.before and _narrows(*reversed(self._filter(f)))]

    def _filter(self, name: str) -> tuple[frozenset[str] | None, frozenset[str] | None]:
        return getattr(self.before, name), getattr(self.after, name)


def _narrows(old: frozenset[str] | None, new: frozenset[str] | None) -> bool:
    """Whether ``new`` refuses some value ``old`` took (None: every value)."""
    return new is not None and (old is None or not old <= new)


def _meet(old: frozenset[str] | None, new: frozenset[str] | None) -> frozenset[str] | None:
    """The values both filters take (None: every value)."""
    if old is None or new is None:
        return new if old is None else old
    return old & new


@dataclass
class Outcome:
    """What :func:`add` or :func:`set_options` did, or would do: the change, what the
    checks found, the options not given that it resets to their defaults, how many
    events waiting after the checkpoint a narrowed filter drops, and whether it was
    applied (a reset or a narrowed filter is applied only with ``yes``)."""

    change: Change
    report: Report
    resets: list[Difference]
    dropped: Lag | None = None
    applied: bool = False

    @property
    def needs_yes(self) -> bool:
        return bool(self.resets or self.change.narrowed)


def add(
    setup: Setup,
    store: DefinitionStore,
    options: Mapping[str, Any],
    *,
    start: StartFrom = StartFrom.BEGINNING,
    replace: bool = False,
    given: Collection[str] = (),
    yes: bool = False,
    indexing: Callable[[int], None] = lambda parts: None,
    actor: Actor = _NO_ONE,
) -> Outcome:
    """``subscribers add``: a new subscriber, or with ``replace`` a new definition of an
    existing one. ``given``: the fields the operator gave; with ``replace``, every other
    field takes its default (the part count, fixed at creation, stays), which is applied
    only with ``yes``. ``indexing`` is told before the part indexes of a new split
    subscriber are built (it waits for the transactions open on the outbox). The
    definition is checked against ``setup`` (the command line loads it as the relay does)."""
    # Without replace, an existing subscriber is refused as the definition is written.
    state = _stored(store, options["name"]) if replace else None
    if state is not None and "parts" not in given:
        options = {**options, "parts": state.subscriber.parts}
    outcome = _propose(setup, store, state, define(setup, options), start, given)
    if outcome.change.changed and (yes or not outcome.needs_yes):
        _write(store, outcome, Action.REPLACE if replace and state else Action.ADD, actor)
        if state is None and outcome.change.after.parts > 1:
            indexing(outcome.change.after.parts)
            store.index_parts()
    return outcome


def set_options(
    setup: Setup,
    store: DefinitionStore,
    name: str,
    options: Mapping[str, Any],
    *,
    unset: Collection[str] = (),
    yes: bool = False,
    dry_run: bool = False,
    actor: Actor = _NO_ONE,
) -> Outcome:
    """``subscribers set``: change only the options given (None: not given) and set
    those in ``unset`` back to their defaults; the rest of the stored definition stays.
    A narrowed filter is applied only with ``yes``; ``dry_run`` writes nothing. Checked
    as :func:`add` checks."""
    state = store.get(name)
    given = {k: v for k, v in options.items() if v is not None}
    clash = sorted(set(given) & set(unset))
    if clash:
        raise SubscriberError(f"{', '.join(clash)}: both given and unset; choose one")
    fields = {**state.subscriber.as_dict(), **given, **dict.fromkeys(unset)}
    outcome = _propose(setup, store, state, define(setup, fields), StartFrom.BEGINNING, None)
    if outcome.change.changed and not dry_run and (yes or not outcome.needs_yes):
        _write(store, outcome, Action.SET, actor)
    return outcome


def _stored(store: DefinitionStore, name: str) -> SubscriberState | None:
    found = store.list(name)
    return found[0] if found else None


def _propose(
    setup: Setup,
    store: DefinitionStore,
    state: SubscriberState | None,
    after: Subscriber,
    start: StartFrom,
    given: Collection[str] | None,
) -> Outcome:
    """The change from the stored definition to ``after``, checked (a refusal raises);
    ``given`` None: every field was given."""
    if state is not None:
        after = dataclasses.replace(after, paused=state.subscriber.paused)
    change = Change(None if state is None else state.subscriber, after, start)
    report = check(setup, [after])
    report.refuse()
    if any(declared.name == after.name for declared in setup.settings.subscribers):
        report.warnings.append(
            f"subscriber {after.name!r} is declared in the config file: a relay writes the "
            "config's definition again when it starts; change it there too"
        )
    resets = [d for d in change.differences if given is not None and d.field not in given]
    dropped = None if state is None or not change.narrowed else _dropped(store, state, after)
    return Outcome(change, report, resets, dropped)


def _dropped(store: DefinitionStore, state: SubscriberState, after: Subscriber) -> Lag:
    """The events waiting after the checkpoint that ``after``'s filters no longer take."""
    before = state.subscriber
    kept = dataclasses.replace(
        before,
        aggregate_types=_meet(before.aggregate_types, after.aggregate_types),
        event_types=_meet(before.event_types, after.event_types),
    )
    waiting = subscriber_lag(store, state)
    still = subscriber_lag(store, _as(state, kept))
    return Lag(waiting.events - still.events, estimated=waiting.estimated or still.estimated)


def _as(state: SubscriberState, subscriber: Subscriber) -> SubscriberState:
    parts = [dataclasses.replace(p, subscriber=subscriber) for p in state.parts]
    return SubscriberState(subscriber, state.subscriber_id, parts)


def _write(store: DefinitionStore, outcome: Outcome, action: Action, actor: Actor) -> None:
    """The change and its ledger entry, in one transaction: on the record, or not made."""
    change = outcome.change
    with store.transaction():
        if change.before is None:
            store.add(change.after, change.start)
        else:
            # Only if the stored definition is still the one the change was computed from.
            store.replace(change.before, change.after)
        store.record(_entry(store, change, action, actor))
    outcome.applied = True


def _entry(store: DefinitionStore, change: Change, action: Action, actor: Actor) -> Intervention:
    """The ledger entry of a definition written: before and after, field by field."""
    params: dict[str, Any] = {"after": change.after.as_dict()}
    if change.before is None:
        params["from"] = change.start.value
    else:
        params["before"] = change.before.as_dict()
        params["changed"] = [str(d) for d in change.differences]
    subscriber_id = store.get(change.after.name).subscriber_id
    return Intervention(action, change.after.name, subscriber_id, actor, params)


# -- the relay's start-up --------------------------------------------------------------


def sync(setup: Setup, store: DefinitionStore) -> list[Change]:
    """Write the subscribers the config declares (the config wins: each is defined anew
    from it, its pause kept), and the default subscriber when there is none anywhere,
    once every subscriber that would then be active has passed :func:`check`. A refusal
    writes nothing (a new subscriber is not created, a changed one stays as stored), and
    the writes are one transaction: a collision or a part count refused there undoes
    them all. Returns the changes written."""
    stored = {s.subscriber.name: s.subscriber for s in store.list()}
    changes = []
    for declared in setup.settings.subscribers:
        after = define(setup, declared.model_dump())
        before = stored.get(after.name)
        if before is not None:
            after = dataclasses.replace(after, paused=before.paused)
        if after != before:
            changes.append(Change(before, after, declared.start_from))
    if not stored and not setup.settings.subscribers:
        default = Subscriber(DEFAULT_SUBSCRIBER, value_format=setup.default_format)
        changes.append(Change(None, default))
    would_be = {**stored, **{c.after.name: c.after for c in changes}}
    active = [s for s in would_be.values() if not s.paused]
    report = check(setup, active, broker_required=False)
    for line in report.warnings:
        logger.warning("%s", line, extra=log_extra("subscriber_check_skipped", problem=line))
    report.refuse(lambda name: _fix_at_start(name, stored, changes))
    with store.transaction():
        store.add_all([(c.after, c.start) for c in changes])
        _record_from_config(store, changes)
    _log_sync(changes, report, {declared.name for declared in setup.settings.subscribers})
    return changes


def _record_from_config(store: DefinitionStore, changes: Sequence[Change]) -> None:
    """Put the definitions a relay wrote from its config on the ledger (by the relay's
    role and host): a changed config changes what a subscriber publishes as much as a
    `set` does. On a schema before migration 0019 (relays roll before `migrate`) there
    is no ledger yet, and the relay starts all the same."""
    actor = Actor(None, socket.gethostname() or None)
    try:
        with store.transaction():  # a savepoint: the writes stand without it
            for change in changes:
                action = Action.ADD if change.before is None else Action.SET
                entry = _entry(store, change, action, actor)
                store.record(
                    dataclasses.replace(entry, params={**entry.params, "source": "config"})
                )
    except NotMigratedError:
        logger.info(
            "the definitions written from the config are not on the ledger: migration 0019 "
            "is not applied",
            extra=log_extra("subscriber_ledger_missing"),
        )


def _fix_at_start(name: str, stored: Mapping[str, Subscriber], changes: Sequence[Change]) -> str:
    """What to do about a refused subscriber, and that the refusal wrote nothing."""
    pause = f"or pause it to start without it: outbox-relay subscribers pause {name}"
    if name not in stored:
        return (
            f"nothing was written: subscriber {name!r} is not created; fix its definition "
            "in the config file, or remove it from there"
        )
    if any(c.after.name == name for c in changes):
        return (
            f"nothing was written: subscriber {name!r} stays as stored; fix its definition "
            f"in the config file, {pause}"
        )
    return f"fix it, {pause}"


def _log_sync(changes: Sequence[Change], report: Report, configured: Collection[str]) -> None:
    for change in changes:
        name, differences = change.after.name, "; ".join(map(str, change.differences))
        if change.before is not None:
            logger.info(
                "updated subscriber %s from config: %s",
                name,
                differences,
                extra=log_extra("subscriber_from_config", subscriber=name, new=False),
            )
        elif name not in configured:
            logger.info(
                "no subscriber configured: created %r routing every event as %s",
                name,
                change.after.value_format,
                extra=log_extra("subscriber_default_created", subscriber=name),
            )
        else:
            logger.info(
                "created subscriber %s from config",
                name,
                extra=log_extra("subscriber_from_config", subscriber=name, new=True),
            )
    for line in [*report.checked, *report.unchecked]:
        logger.info("%s", line, extra=log_extra("registry_checked"))


# -- resume --------------------------------------------------------------------------


@dataclass(frozen=True)
class Resumed:
    """A subscriber resumed: whether it was paused, and its halted parts' errors."""

    name: str
    paused: bool
    halted: dict[int, str]


def resume(
    store: DefinitionStore, names: Sequence[str] | None, actor: Actor = _NO_ONE
) -> list[Resumed]:
    """Resume the subscribers named, or (None) every paused or halted one, from their
    checkpoints; a poison halt is cleared (the part retries the event)."""
    states = store.list() if names is None else [store.get(name) for name in names]
    found = [
        Resumed(
            s.subscriber.name,
            s.subscriber.paused,
            {p.part: p.halted_error for p in s.parts if p.halted_error is not None},
        )
        for s in states
    ]
    if names is None:
        found = [r for r in found if r.paused or r.halted]
    for resumed in found:
        interventions.set_paused(store, resumed.name, False, actor)  # on the ledger
    return found
