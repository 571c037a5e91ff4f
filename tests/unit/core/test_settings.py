"""Settings: flags > RELAY_* environment > TOML file > defaults; errors name the key."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from relay.core.settings import load_settings, unknown_variables
from relay.errors import ConfigError


def test_precedence_flags_over_env_over_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(
        '[relay]\nbootstrap_servers = "file:9092"\nbatch_size = 10\npoll_interval = 3.0\n'
        '[relay.kafka]\n"security.protocol" = "SSL"\n'
        '[[relay.subscribers]]\nname = "billing"\naggregate_types = ["order"]\nvalue_format = "json"\n'
    )
    monkeypatch.setenv("RELAY_BATCH_SIZE", "20")
    monkeypatch.setenv("RELAY_POLL_INTERVAL", "2.0")
    settings = load_settings(config, poll_interval=1.5)
    assert settings.bootstrap_servers == "file:9092"
    assert settings.batch_size == 20
    assert settings.poll_interval == 1.5
    assert settings.kafka == {"security.protocol": "SSL"}
    assert settings.subscribers[0].aggregate_types == ["order"]


def test_nested_kafka_options_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_KAFKA__SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("RELAY_KAFKA__SASL_MECHANISM", "PLAIN")
    assert load_settings().kafka == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"}


def test_database_url_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresql://u:hunter2@db/app")
    settings = load_settings()
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)
    assert settings.require_database_url() == "postgresql://u:hunter2@db/app"


@pytest.mark.parametrize(
    ("document", "key"),
    [
        ("batch_size = 0", "batch_size"),
        ('batch_size = "many"', "batch_size"),
        ("no_such_key = 1", "no_such_key"),
        ("batch_max_bytes = 10", "batch_max_bytes"),
        ("max_created_topics = -2", "max_created_topics"),
        ("max_producers = 0", "max_producers"),
        ("topic_allow = '(order'", "topic_allow"),
        ('[[subscribers]]\nname = "bad name!"', "subscribers.0.name"),
        ('[[subscribers]]\nname = "a"\ntopic = "x.{nope}"', "subscribers.0.topic"),
        ('[[subscribers]]\nname = "a"\nvalue_format = "xml"', "subscribers.0.value_format"),
        ('[[subscribers]]\nname = "a"\n[[subscribers]]\nname = "a"', "subscribers"),
    ],
)
def test_errors_name_the_offending_key(tmp_path: Path, document: str, key: str) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(document)
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert f"\n  {key}" in str(info.value)


def test_a_config_subscribers_dead_letter_topic_needs_the_dead_letter_policy(
    tmp_path: Path,
) -> None:
    """Issue #28: as `subscribers add --dead-letter-topic` without `--on-poison
    dead-letter` is refused, so is the same subscriber in the config file, naming the key
    (it used to be accepted, and its topic ignored: poison halted the part)."""
    config = tmp_path / "relay.toml"
    config.write_text('[[subscribers]]\nname = "a"\ndead_letter_topic = "a.dlq"\n')
    with pytest.raises(ConfigError) as info:
        load_settings(config)
    assert "\n  subscribers.0.dead_letter_topic" in str(info.value)
    assert "on_poison" in str(info.value)
    config.write_text(
        '[[subscribers]]\nname = "a"\non_poison = "dead-letter"\ndead_letter_topic = "a.dlq"\n'
    )
    assert load_settings(config).subscribers[0].dead_letter_topic == "a.dlq"


def test_max_producers_bounds_a_relays_producers(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text("max_producers = 3")
    assert load_settings(config).max_producers == 3
    assert load_settings().max_producers == 8


def test_unreadable_config_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_size = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(bad)


def test_env_var_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_POLL_INTERVAL", "soon")
    with pytest.raises(ConfigError, match=r"poll_interval \(RELAY_POLL_INTERVAL\)"):
        load_settings()


def test_secrets_can_come_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, kafka = tmp_path / "url", tmp_path / "kafka.json"
    url.write_text("postgresql://relay:s3cret@db/app\n")
    kafka.write_text('{"sasl.password": "hunter2", "security.protocol": "SASL_SSL"}')
    monkeypatch.setenv("RELAY_DATABASE_URL_FILE", str(url))
    monkeypatch.setenv("RELAY_KAFKA_FILE", str(kafka))
    settings = load_settings()
    assert settings.require_database_url() == "postgresql://relay:s3cret@db/app"
    assert settings.kafka["sasl.password"] == "hunter2"
    assert "s3cret" not in repr(settings) and "hunter2" not in repr(settings)
    monkeypatch.setenv("RELAY_KAFKA_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="RELAY_KAFKA_FILE"):
        load_settings()


@pytest.mark.parametrize(
    ("contents", "why"),
    [
        (b"", "is empty"),
        (b"\n  \n", "is empty"),
        (b"postgresql://relay:\xffs3cret@db/app", "is not UTF-8 text"),
    ],
)
def test_a_secret_file_that_holds_no_secret_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, contents: bytes, why: str
) -> None:
    """Issue #47 (k8s secrets as files): an empty file used to become an empty URL,
    which libpq reads as "the local socket, as this OS user"."""
    secret = tmp_path / "database-url"
    secret.write_bytes(contents)
    monkeypatch.setenv("RELAY_DATABASE_URL_FILE", str(secret))
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == f"database_url (RELAY_DATABASE_URL_FILE): {secret} {why}"


def test_a_mistyped_url_in_a_secret_file_names_the_key_and_hides_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "database-url"
    secret.write_text("postgresq://relay:S3CRET-in-file@db/app\n")
    monkeypatch.setenv("RELAY_DATABASE_URL_FILE", str(secret))
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "database_url" in str(info.value) and "S3CRET" not in str(info.value)


def test_a_mistyped_database_url_names_the_key_and_hides_the_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", "postgresq://user:SECRET@host/db")
    with pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert "database_url (RELAY_DATABASE_URL)" in message
    assert "postgresq://user:***@host/db" in message and "SECRET" not in message


_PEM = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"


def test_kafka_keys_pems_and_secrets_are_masked_in_reprs_logs_and_errors(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging

    from relay.core.redact import redact
    from relay.observability import logs

    secrets = {
        "ssl.key.pem": _PEM,
        "ssl.certificate.pem": "-----BEGIN CERTIFICATE-----\nMIIDcertificate\n",
        "sasl.oauthbearer.client.secret": "client-s3cret",
        "ssl.keystore.password": "keystore-pw",
        "sasl.oauthbearer.assertion.private.key.passphrase": "pass-phrase",
    }
    monkeypatch.setenv("RELAY_KAFKA", json.dumps({**secrets, "security.protocol": "SSL"}))
    settings = load_settings()
    assert settings.kafka["ssl.key.pem"] == _PEM
    shown = {"repr": repr(settings), "str": str(settings)}
    message = "librdkafka: ssl.key.pem " + _PEM.replace("\n", " ") + " client-s3cret"
    shown["error"] = redact(message)
    logs.configure("INFO", "text")
    logging.getLogger("relay.test").warning("config %s", settings.kafka)
    shown["log"] = capsys.readouterr().err
    assert "SSL" in shown["repr"]  # the rest is still there
    for where, text in shown.items():
        for value in secrets.values():
            body = value.splitlines()[1] if "\n" in value else value  # a PEM's base64
            assert body not in text, (where, value)


# libpq quotes the token it cannot parse, and that can be the password alone.
_UNPARSABLE_PASSWORDS = [
    ("postgresql://u:S3cr%ZZet@host/db", "S3cr%ZZet"),
    ("postgresql://u:S3cr et@host/db", "S3cr et"),
    ("postgresql://u@host/db?password=S3cr%ZZet", "S3cr%ZZet"),
    # Parsed, but part of the password taken for the host or the port.
    ("postgresql://u:S3cr@et@host/db", "et@host"),
    ("postgresql://u:S3cr/et@host/db", "S3cr"),
]


@pytest.mark.parametrize(("url", "password"), _UNPARSABLE_PASSWORDS)
def test_a_password_libpq_cannot_parse_is_never_shown(
    monkeypatch: pytest.MonkeyPatch, url: str, password: str
) -> None:
    monkeypatch.setenv("RELAY_DATABASE_URL", url)
    with pytest.raises(ConfigError) as info:
        load_settings()
    shown = [str(info.value)]
    cause: BaseException | None = info.value
    while cause is not None:  # a traceback shows every chained error
        shown.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    assert "database_url (RELAY_DATABASE_URL)" in shown[0] and "percent-encode" in shown[0]
    assert not [text for text in shown if password in text]


@pytest.mark.parametrize(("url", "password"), _UNPARSABLE_PASSWORDS)
def test_the_cli_never_shows_a_password_libpq_cannot_parse(url: str, password: str) -> None:
    from tests.support import run_cli

    result = run_cli("status", env={"RELAY_DATABASE_URL": url})
    assert result.returncode == 2, result.stderr
    assert "database_url" in result.stderr and "percent-encode" in result.stderr
    assert password not in result.stdout + result.stderr


def test_malformed_json_in_a_variable_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_KAFKA", '{"sasl.password": "SECRET", oops}')
    with pytest.raises(ConfigError, match='field "kafka"') as info:
        load_settings()
    assert "SECRET" not in str(info.value)


def test_log_lines_and_tracebacks_mask_passwords(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    import psycopg

    from relay.adapters.postgres.db import wrap_errors
    from relay.errors import RelayError
    from relay.observability import logs

    for fmt in ("text", "json"):
        logs.configure("INFO", fmt)
        try:
            with wrap_errors():
                raise psycopg.OperationalError('no route to "postgresql://app:SECRET@db/app"')
        except RelayError:
            logging.getLogger("relay.test").exception(
                "cannot reach %s", "host=db password='SEC RET' user=app"
            )
        written = capsys.readouterr().err
        assert "postgresql://app:***@db/app" in written and "password=***" in written
        assert "SECRET" not in written and "SEC RET" not in written
        assert "Traceback" in written or '"exception"' in written


def test_the_probe_port_follows_the_metrics_port_unless_set() -> None:
    assert load_settings().probe_listen_port == 9188
    assert load_settings(metrics_port=0).probe_listen_port == 0  # any free port, both
    assert load_settings(metrics_port=9300, probe_port=8081).probe_listen_port == 8081
    for clash in ({"metrics_port": 9300, "probe_port": 9300}, {"metrics_port": 65535}):
        with pytest.raises(ConfigError, match="probe_port"):
            load_settings(**clash)


def test_a_mistyped_relay_variable_is_found_with_the_name_meant() -> None:
    """Issue #52: a mistyped RELAY_* variable was ignored without a word."""
    environ = {
        "RELAY_BOOTSTRAP_SERVER": "kafka:9092",  # the S forgotten
        "RELAY_DATABASE_URL": "postgresql://x",
        "RELAY_DATABASE_URL_FILE": "/run/secrets/url",
        "RELAY_KAFKA__SECURITY_PROTOCOL": "SSL",  # a key of a nested setting
        "RELAY_CONFIG": "relay.toml",
        "RELAY_CACHE_DIR": "/cache",
        "RELAY_FROBNICATE": "1",
        "PATH": "/bin",
    }
    assert unknown_variables(environ) == [
        ("RELAY_BOOTSTRAP_SERVER", "RELAY_BOOTSTRAP_SERVERS"),
        ("RELAY_FROBNICATE", None),
    ]


def test_the_cli_warns_of_an_unknown_relay_variable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from relay.cli.common import _warn_unknown_variables

    monkeypatch.setenv("RELAY_METRICS_PROT", "9187")
    with caplog.at_level(logging.WARNING, logger="relay.cli.common"):
        _warn_unknown_variables()
    assert [r.getMessage() for r in caplog.records] == [
        "RELAY_METRICS_PROT is set, but no setting reads it (did you mean RELAY_METRICS_PORT?)"
    ]
