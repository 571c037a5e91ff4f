"""The Helm chart in deploy/helm/outbox-relay, under the real helm (the ``helm`` fixture,
tests/plugins/helm.py): ``helm lint``, ``helm template`` with the default values and with
deploy/helm/examples/every-option.yaml, and the rendered objects checked against what
deploy/k8s/ ships (probes, security contexts), the Kubernetes API schemas
(kubernetes-validate, as tests/acceptance/test_deploy.py does) and the relay's own
settings loader (the TOML the chart renders from values).
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from relay.core.settings import Settings, load_settings
from relay.errors import ConfigError
from tests.acceptance.test_deploy import KNOWN_ENV, REPO, k8s_errors, k8s_one
from tests.plugins.gotool import run_tool

pytestmark = [pytest.mark.helm, pytest.mark.timeout(1800)]  # the first use builds helm

CHART = REPO / "deploy" / "helm" / "outbox-relay"
EVERY_OPTION = REPO / "deploy" / "helm" / "examples" / "every-option.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "outbox-relay.json"
# Custom resources: kubernetes-validate has no schema for them (checked by hand below).
CUSTOM_KINDS = {"ServiceMonitor"}
HOOKS = "pre-install,pre-upgrade"


def helm_run(helm: Path, *args: str | Path) -> str:
    done = run_tool(helm, *args, cwd=REPO)
    assert done.returncode == 0, (
        f"helm {shlex.join(map(str, args))}: exit {done.returncode}\n{done.stderr}"
    )
    return done.stdout


def render(helm: Path, *args: str | Path) -> list[dict[str, Any]]:
    out = helm_run(helm, "template", "outbox-relay", CHART, *args)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    c: dict[str, Any] = only
    return c


@pytest.fixture(scope="module")
def default(helm: Path) -> list[dict[str, Any]]:
    return render(helm)


@pytest.fixture(scope="module")
def full(helm: Path) -> list[dict[str, Any]]:
    return render(helm, "-f", EVERY_OPTION)


def test_the_charts_app_version_is_the_packages() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]


@pytest.mark.parametrize("values", [[], ["-f", EVERY_OPTION]], ids=["default", "every-option"])
def test_helm_lint_passes(helm: Path, values: list[str | Path]) -> None:
    helm_run(helm, "lint", "--strict", CHART, *values)


def test_helm_lint_rejects_a_broken_chart(helm: Path, tmp_path: Path) -> None:
    broken = tmp_path / "outbox-relay"
    broken.mkdir()
    (broken / "Chart.yaml").write_text((CHART / "Chart.yaml").read_text())
    (broken / "templates").mkdir()
    (broken / "templates" / "bad.yaml").write_text("kind: {{ .Values.nope.deeper }}\n")
    assert run_tool(helm, "lint", "--strict", broken).returncode != 0


def test_default_values_render_the_relay_and_its_hooks(default: list[dict[str, Any]]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in default)
    assert kinds == [
        ("ConfigMap", "outbox-relay"),
        ("Deployment", "outbox-relay"),
        ("Job", "outbox-relay-grant"),
        ("Job", "outbox-relay-migrate"),
        ("NetworkPolicy", "outbox-relay"),
        ("PodDisruptionBudget", "outbox-relay"),
        ("Service", "outbox-relay-metrics"),
    ]


def test_every_option_adds_the_service_monitor_and_the_dashboard(
    full: list[dict[str, Any]],
) -> None:
    monitor = one(full, "ServiceMonitor", "outbox-relay")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    service = one(full, "Service", "outbox-relay-metrics")
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert service["spec"]["ports"][0]["port"] == 9190
    dashboard = one(full, "ConfigMap", "outbox-relay-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(DASHBOARD.read_text())
    assert json.loads(dashboard["data"]["outbox-relay.json"]) == shipped


@pytest.mark.parametrize("values", ["default", "full"])
def test_every_rendered_object_is_valid(values: str, request: pytest.FixtureRequest) -> None:
    objects: list[dict[str, Any]] = request.getfixturevalue(values)
    errors = {
        f"{o['kind']}/{o['metadata']['name']}": k8s_errors(o)
        for o in objects
        if o["kind"] not in CUSTOM_KINDS
    }
    assert not {k: v for k, v in errors.items() if v}


def test_the_validator_sees_the_rendered_objects(default: list[dict[str, Any]]) -> None:
    """A broken rendered Deployment is refused: the check above can fail."""
    deployment = json.loads(json.dumps(one(default, "Deployment", "outbox-relay")))
    container(deployment)["livenessProbe"]["periodSeconds"] = "often"
    assert k8s_errors(deployment)


@pytest.mark.parametrize("values", ["default", "full"])
def test_probes_and_security_are_deploy_k8s(values: str, request: pytest.FixtureRequest) -> None:
    objects: list[dict[str, Any]] = request.getfixturevalue(values)
    shipped = k8s_one("Deployment", "outbox-relay")
    rendered = one(objects, "Deployment", "outbox-relay")
    for key in ("startupProbe", "livenessProbe", "readinessProbe", "securityContext"):
        assert container(rendered)[key] == container(shipped)[key], key
    pod, shipped_pod = rendered["spec"]["template"]["spec"], shipped["spec"]["template"]["spec"]
    for key in ("securityContext", "automountServiceAccountToken", "enableServiceLinks"):
        assert pod[key] == shipped_pod[key], key
    assert rendered["spec"]["strategy"] == shipped["spec"]["strategy"]
    if values == "default":
        assert container(rendered)["resources"] == container(shipped)["resources"]
        assert pod["terminationGracePeriodSeconds"] == shipped_pod["terminationGracePeriodSeconds"]
        assert rendered["spec"]["replicas"] == shipped["spec"]["replicas"]
    for job in ("migrate", "grant"):
        ours = one(objects, "Job", f"outbox-relay-{job}")
        theirs = k8s_one("Job", f"outbox-relay-{job}")
        assert container(ours)["securityContext"] == container(theirs)["securityContext"]
        assert (
            ours["spec"]["template"]["spec"]["securityContext"]
            == (theirs["spec"]["template"]["spec"]["securityContext"])
        )


def test_pdb_and_network_policy_are_deploy_k8s(default: list[dict[str, Any]]) -> None:
    deployment = one(default, "Deployment", "outbox-relay")
    selector = deployment["spec"]["selector"]["matchLabels"]
    pdb = one(default, "PodDisruptionBudget", "outbox-relay")
    shipped_pdb = k8s_one("PodDisruptionBudget", "outbox-relay")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == {
        k: v for k, v in shipped_pdb["spec"].items() if k != "selector"
    }
    policy = one(default, "NetworkPolicy", "outbox-relay")
    shipped_policy = k8s_one("NetworkPolicy", "outbox-relay")
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    assert policy["spec"]["ingress"] == shipped_policy["spec"]["ingress"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


@pytest.mark.parametrize("values", ["default", "full"])
def test_migrate_then_grant_run_as_hooks(values: str, request: pytest.FixtureRequest) -> None:
    objects: list[dict[str, Any]] = request.getfixturevalue(values)
    weights = {}
    for job in ("migrate", "grant"):
        annotations = one(objects, "Job", f"outbox-relay-{job}")["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == HOOKS
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
        weights[job] = int(annotations["helm.sh/hook-weight"])
    assert weights["migrate"] < weights["grant"], "grant needs the tables migrate makes"
    # Hooks run before the release's ConfigMap exists: they must not read it.
    for job in ("migrate", "grant"):
        spec = one(objects, "Job", f"outbox-relay-{job}")["spec"]["template"]["spec"]
        assert "envFrom" not in spec["containers"][0]
        assert all("configMap" not in v for v in spec["volumes"])
    grant = container(one(objects, "Job", "outbox-relay-grant"))["args"]
    expected = {
        "default": ["grant", "--relay-role", "outbox_relay", "--create"],
        "full": ["grant", "--relay-role", "orders_relay"],
    }
    assert grant == expected[values]


def _secret_mounts(obj: dict[str, Any]) -> dict[str, str]:
    """mount path -> Secret name, for each Secret volume the pod mounts."""
    pod = obj["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    for secret in secrets.values():
        assert secret["defaultMode"] == 0o440
    return {
        m["mountPath"]: secrets[m["name"]]["secretName"]
        for m in container(obj)["volumeMounts"]
        if m["name"] in secrets and m["readOnly"]
    }


@pytest.mark.parametrize("values", ["default", "full"])
def test_secrets_are_files_one_secret_per_role(values: str, request: pytest.FixtureRequest) -> None:
    objects: list[dict[str, Any]] = request.getfixturevalue(values)
    owner, relay = {
        "default": ("outbox-relay-owner", "outbox-relay"),
        "full": ("orders-owner", "orders-relay"),
    }[values]
    roles = {
        "Deployment/outbox-relay": relay,
        "Job/outbox-relay-migrate": owner,
        "Job/outbox-relay-grant": owner,
    }
    for key, role in roles.items():
        kind, name = key.split("/")
        obj = one(objects, kind, name)
        mounts = _secret_mounts(obj)
        env = container(obj)["env"]
        assert not any("valueFrom" in e for e in env), f"{key}: a secret as a variable"
        files = [e["value"] for e in env if e["name"].endswith("_FILE")]
        assert files, key
        for path in files:
            (secret,) = [s for m, s in mounts.items() if path.startswith(m + "/")]
            assert secret == role, f"{key} reads {path} from {secret}, not its role's {role}"
        assert {e["name"] for e in env if e["name"].startswith("RELAY_")} <= KNOWN_ENV | {
            "RELAY_CONFIG"
        }
    assert owner not in _secret_mounts(one(objects, "Deployment", "outbox-relay")).values()


def _settings(
    objects: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    """The relay's settings as a rendered relay pod would load them: its TOML file from the
    ConfigMap, its secret files (placeholders here) at the paths its env names."""
    deployment = one(objects, "Deployment", "outbox-relay")
    env = {e["name"]: e["value"] for e in container(deployment)["env"]}
    config = one(objects, "ConfigMap", "outbox-relay")["data"]["relay.toml"]
    assert env["RELAY_CONFIG"] == "/etc/outbox-relay/relay.toml"
    (tmp_path / "relay.toml").write_text(config)
    placeholders = {
        "RELAY_DATABASE_URL_FILE": "postgresql://relay@db.example.invalid/app",
        "RELAY_KAFKA_FILE": '{"sasl.password": "placeholder"}',
        "RELAY_SCHEMA_REGISTRY_PASSWORD_FILE": "placeholder",
    }
    for name in env:
        if name.endswith("_FILE"):
            path = tmp_path / name
            path.write_text(placeholders[name])
            monkeypatch.setenv(name, str(path))
    return load_settings(tmp_path / "relay.toml")


def test_the_default_config_is_the_relays_settings(
    default: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(default, tmp_path, monkeypatch)
    assert [s.name for s in settings.subscribers] == ["default"]
    assert settings.bootstrap_servers == "kafka-bootstrap:9092"
    assert (settings.metrics_host, settings.metrics_port, settings.probe_port) == (
        "0.0.0.0",
        9187,
        9188,
    )
    assert settings.kafka == {}
    assert settings.delivery == "transactional" and settings.log_format == "json"
    assert not settings.tracing and settings.schema_registry_url is None


def test_every_option_config_is_the_relays_settings(
    full: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _settings(full, tmp_path, monkeypatch)
    orders, audit = settings.subscribers
    assert (orders.name, orders.value_format, orders.parts) == ("orders", "avro-registry", 3)
    assert orders.dead_letter_topic == "orders.dead-letter"
    assert (audit.topic, audit.start_from) == ("audit.{aggregate_type}", "now")
    assert settings.kafka == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "orders-relay",
        "sasl.password": "placeholder",  # the relays' Secret, merged
        "ssl.ca.location": "/run/secrets/kafka-ca/ca.crt",
        "compression.type": "zstd",
    }
    assert settings.schema_registry_url == "https://registry.example.invalid/apis/ccompat/v7"
    assert settings.schema_registry_password is not None
    assert str(settings.schema_registry_ca) == "/run/secrets/schema-registry-ca/ca.crt"
    assert str(settings.schemas_dir) == "/app/schemas"
    assert settings.tracing and settings.tracing_spans == "event"
    assert settings.tracing_sample_ratio == 0.1
    assert (settings.workers, settings.batch_size, settings.database_schema) == (2, 2000, "orders")
    mounted = {
        m["mountPath"] for m in container(one(full, "Deployment", "outbox-relay"))["volumeMounts"]
    }
    for path in (
        settings.schemas_dir,
        settings.schema_registry_ca,
        Path(settings.kafka["ssl.ca.location"]),
    ):
        assert path is not None and any(str(path).startswith(m) for m in mounted), path


def test_a_bad_subscriber_value_fails_the_settings_check(
    helm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(
        helm, "--set", "subscribers[0].name=default", "--set", "subscribers[0].parts=0"
    )
    with pytest.raises(ConfigError, match="parts"):
        _settings(objects, tmp_path, monkeypatch)


def _readme_helm_lines() -> list[list[str]]:
    text = (REPO / "deploy" / "README.md").read_text()
    section = text.split("\n## Helm\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    lines = "".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in (raw.split("#", 1)[0].strip() for raw in lines) if line]


def test_the_readmes_helm_commands_run(helm: Path) -> None:
    """deploy/README.md's Helm section, each command as written; but kubectl's, which only
    create the Secrets (their names and keys are checked below), and ``helm install``,
    which needs a cluster even with --dry-run: it runs as ``helm template`` with the same
    arguments, which renders what install would apply."""
    commands = _readme_helm_lines()
    ran = []
    for command in commands:
        if command[0] == "kubectl":
            assert command[1:4] == ["create", "secret", "generic"], command
            continue
        assert command[0] == "helm", command
        verb, *args = command[1:]
        done = run_tool(helm, "template" if verb == "install" else verb, *args, cwd=REPO)
        assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr}"
        ran.append(verb)
    assert ran == ["lint", "template", "install"], ran
    secrets = {c[4]: c[5:] for c in commands if c[0] == "kubectl"}
    assert secrets == {
        "outbox-relay-owner": ["--from-literal=database-url=..."],
        "outbox-relay": ["--from-literal=database-url=..."],
    }, "the Secrets the default values name, with the key the pods read"
