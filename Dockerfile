# outbox-relay container image.
#
#   docker build -t outbox-relay .
#   docker run --rm --read-only --tmpfs /tmp \
#     -e RELAY_DATABASE_URL=postgresql://relay@db:5432/app -e RELAY_BOOTSTRAP_SERVERS=kafka:9092 \
#     outbox-relay                      # = outbox-relay run
#   docker run --rm outbox-relay migrate --database-url ...
#
# The image runs as UID/GID 10001, never writes outside /tmp, and works with a
# read-only root filesystem (mount a tmpfs on /tmp). See deploy/README.md.

ARG PYTHON_IMAGE=python:3.11-slim

# --- builder: wheel from pyproject.toml, installed with its dependencies into a venv ---
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
# Every runtime dependency ships manylinux wheels (psycopg[binary] bundles libpq,
# confluent-kafka bundles librdkafka), so no compiler or -dev packages are needed.
COPY pyproject.toml README.md ./
COPY relay ./relay
COPY spark_jobs ./spark_jobs
# The venv gets no pip/setuptools of its own: the builder's pip installs into it.
RUN python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv --without-pip /opt/venv \
 && python -m pip --python /opt/venv/bin/python install /wheels/*.whl

# --- runtime ---
FROM ${PYTHON_IMAGE} AS runtime

ARG RELAY_UID=10001
# PYTHONDONTWRITEBYTECODE: the root filesystem may be read-only (the venv's .pyc files
# were compiled in the builder). HOME/TMPDIR: the only writable place is /tmp.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONFAULTHANDLER=1 \
    HOME=/tmp \
    TMPDIR=/tmp

RUN groupadd --system --gid ${RELAY_UID} relay \
 && useradd --system --uid ${RELAY_UID} --gid ${RELAY_UID} --home-dir /tmp \
        --no-create-home --shell /usr/sbin/nologin relay

COPY --from=builder /opt/venv /opt/venv

# The default schemas_dir is the relative path "schemas": WORKDIR makes it /app/schemas.
# Replace the demo schemas by mounting your own over /app/schemas (read-only is fine)
# or by building FROM this image with `COPY schemas/ /app/schemas/`.
WORKDIR /app
COPY schemas/ /app/schemas/

# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER ${RELAY_UID}:${RELAY_UID}

# Placeholder: proves the interpreter and the package load. Issue #5 adds an HTTP
# /healthz endpoint (worker states, lag); switch this check to it then.
HEALTHCHECK --interval=30s --timeout=10s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import relay"]

ENTRYPOINT ["outbox-relay"]
CMD ["run"]
