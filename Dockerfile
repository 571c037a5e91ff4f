# outbox-relay container images.
#
#   docker build -t outbox-relay .                          # the relay (default target)
#   docker run --rm --read-only --tmpfs /tmp \
#     -e RELAY_DATABASE_URL=postgresql://relay@db:5432/app -e RELAY_BOOTSTRAP_SERVERS=kafka:9092 \
#     outbox-relay                      # = outbox-relay run
#   docker run --rm outbox-relay migrate --database-url ...
#
#   docker build --target spark -t outbox-relay-spark .     # + PySpark and a JRE
#   docker run --rm --read-only --tmpfs /tmp outbox-relay-spark \
#     spark_jobs.archive --bootstrap-servers kafka:9092 --path /data/archive --checkpoint /data/ckpt
#
# Both images run as UID/GID 10001, never write outside /tmp (and /data in the spark
# image), and work with a read-only root filesystem (mount a tmpfs on /tmp).
# See deploy/README.md and deploy/k8s/.
#
# Stages: builder -> spark-builder (build only); base -> spark, base -> runtime. The
# runtime stage is last, so it is what a plain `docker build` produces.

# Pinned to a Debian release so that the JRE package name below stays valid. Pin it by
# digest too where you build (the tag moves with every rebuild of the base image):
#   docker buildx imagetools inspect python:3.11-slim-trixie --format '{{json .Manifest.Digest}}'
#   docker build --build-arg PYTHON_IMAGE=python:3.11-slim-trixie@sha256:<digest> .
# This repository does not carry a digest: none could be looked up where it is written,
# and an unverified one would be worse than the tag.
ARG PYTHON_IMAGE=python:3.11-slim-trixie

# --- builder: wheel from pyproject.toml, installed with its dependencies into a venv ---
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# Every runtime dependency ships manylinux wheels (psycopg[binary] bundles libpq,
# confluent-kafka bundles librdkafka), so no compiler or -dev packages are needed.
# The dependencies come from requirements.lock: exact versions, each file checked
# against its hash (regenerate it with the command at its top when pyproject.toml's
# dependencies change; tests/acceptance/test_deploy.py checks that they agree).
COPY pyproject.toml README.md requirements.lock requirements-spark.lock ./
COPY relay ./relay
COPY spark_jobs ./spark_jobs
# The venv gets no pip/setuptools of its own: the builder's pip installs into it.
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv --without-pip /opt/venv \
 && python -m pip --python /opt/venv/bin/python install --require-hashes --no-deps \
        -r requirements.lock \
 && python -m pip --python /opt/venv/bin/python install --no-deps /wheels/*.whl

# --- spark-builder: the same venv plus the `spark` extra (pyspark, pyarrow, pandas) ---
FROM builder AS spark-builder
RUN python -m pip --python /opt/venv/bin/python install --require-hashes --no-deps \
        -r requirements-spark.lock

# --- base: what both images share (user, environment, schemas); no venv yet ---
FROM ${PYTHON_IMAGE} AS base

ARG RELAY_UID=10001
# PYTHONDONTWRITEBYTECODE: the root filesystem may be read-only (the venv's .pyc files
# were compiled in the builder). HOME/TMPDIR: the only writable place is /tmp.
# RELAY_SCHEMAS_DIR: absolute, so it does not depend on the working directory.
# RELAY_METRICS_HOST: the relay listens on loopback by default; a container must listen
# on every interface for probes and scrapes to reach it (see deploy/README.md, Security).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    RELAY_SCHEMAS_DIR=/app/schemas \
    RELAY_METRICS_HOST=0.0.0.0

RUN groupadd --system --gid ${RELAY_UID} relay \
 && useradd --system --uid ${RELAY_UID} --gid ${RELAY_UID} --home-dir /tmp \
        --no-create-home --shell /usr/sbin/nologin relay

# Replace the demo schemas by mounting your own over /app/schemas (read-only is fine)
# or by building FROM this image with `COPY schemas/ /app/schemas/`.
WORKDIR /app
COPY schemas/ /app/schemas/

# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER ${RELAY_UID}:${RELAY_UID}

# --- spark: the Spark jobs (python -m spark_jobs.<job>), local mode, with a JRE ---
FROM base AS spark

ARG RELAY_UID=10001
# Numeric root (hadolint DL3066) for the package install only.
USER 0:0
# Spark 4 runs on Java 17 or 21; Debian trixie ships 21. Versions come from the pinned
# Debian release rather than apt pins, which break whenever Debian publishes a fix.
# man1 must exist: the JRE's postinst registers man pages that slim images leave out.
# hadolint ignore=DL3008
RUN apt-get update \
 && mkdir -p /usr/share/man/man1 \
 && apt-get install -y --no-install-recommends openjdk-21-jre-headless \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data \
 && chown ${RELAY_UID}:${RELAY_UID} /data

COPY --from=spark-builder /opt/venv /opt/venv

# Spark's Kafka connector and spark-avro (spark-kafka.lock, spark-avro.lock: SHA-256
# pinned, same version as pyspark) are fetched at build time into a read-only cache, so
# a job starts offline.
ENV RELAY_CACHE_DIR=/opt/outbox-relay/cache
RUN /opt/venv/bin/python -m relay.artifacts.maven fetch spark-kafka \
 && /opt/venv/bin/python -m relay.artifacts.maven fetch spark-avro

# Spark's scratch space and the (unused) SQL warehouse go to /tmp, not to /app.
# /data is owned by the relay user, so a fresh named volume mounted there is writable.
ENV SPARK_LOCAL_DIRS=/tmp \
    PYSPARK_SUBMIT_ARGS="--conf spark.sql.warehouse.dir=/tmp/spark-warehouse pyspark-shell"

USER ${RELAY_UID}:${RELAY_UID}

# A streaming job has no HTTP endpoint; the orchestrator watches the process instead.
HEALTHCHECK NONE

ENTRYPOINT ["python", "-m"]
CMD ["spark_jobs.archive", "--help"]

# --- runtime: the relay (default target) ---
FROM base AS runtime

COPY --from=builder /opt/venv /opt/venv

# The relay serves GET /healthz on probe_port (default metrics_port + 1: 9188), a port
# that serves the probes alone. There is no curl in the slim image, so the check is a
# Python one-liner: urlopen raises on a refused connection, a timeout or any non-2xx
# status, which makes the exit code non-zero.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('RELAY_PROBE_PORT') or int(os.environ.get('RELAY_METRICS_PORT', '9187')) + 1; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % port, timeout=5)"]

EXPOSE 9187 9188

ENTRYPOINT ["outbox-relay"]
CMD ["run"]
