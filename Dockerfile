# syntax=docker/dockerfile:1
# outbox_farm's base image: the package and its dependencies in /opt/venv, a non-root user, the
# `outbox-farm` script as the entrypoint, and no application. An app is a layer on top of it,
# built in the app's own repository: deploy/docker/example-app is one to copy.
#
#   docker build -t outbox-farm-base:0.1.0 .
#   docker build -t outbox-farm:0.1.0 deploy/docker/example-app
#   docker run --rm -e OUTBOX_FARM_DSN_FILE=/run/secrets/dsn -e OUTBOX_FARM_PROCS=2 \
#     -v "$PWD/dsn:/run/secrets/dsn:ro" -p 9464:9464 outbox-farm:0.1.0
# (the DSN file must be readable by the image's user, uid 10001).
#
# Set OUTBOX_FARM_PROCS (the Deployment sets it from its CPU limit): by default there is one
# worker per CPU of the host, which a container's CPU limit does not change.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# Build the wheel and install it, with its dependencies, into a virtual environment that the
# final stage copies whole. Every dependency ships binary wheels, so no compiler is needed here
# either (--only-binary makes a missing one an error, not a compile). EXTRAS adds optional
# dependencies, e.g. --build-arg EXTRAS=kafka,tracing for a Kafka relay with tracing, or
# EXTRAS=console for an image that also runs `outbox-farm console`.
FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m pip install build
COPY pyproject.toml README.md ./
COPY migrations ./migrations
COPY outbox_farm ./outbox_farm
RUN python -m build --wheel --outdir /dist
# The versions installed here become constraints for every later `pip install` (PIP_CONSTRAINT
# below): an app layer's requirements cannot move a dependency of the farm away from the version
# it was built and tested with; a conflict fails the app's build instead.
RUN python -m venv /opt/venv \
    && wheel="$(ls /dist/outbox_farm-*.whl)" \
    && /opt/venv/bin/pip install --only-binary=:all: "${wheel}${EXTRAS:+[$EXTRAS]}" \
    && /opt/venv/bin/pip freeze --exclude outbox-farm > /opt/venv/constraints.txt

FROM ${PYTHON_IMAGE} AS base
# No .pyc written at run time (the root filesystem is read-only in the Deployment): the venv's
# were compiled by pip, an app layer compiles its own. Logs go out unbuffered.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/opt/venv/constraints.txt
RUN groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid outbox --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin outbox
COPY --from=build /opt/venv /opt/venv
# Where an app layer puts the app: `start` imports it from the working directory.
WORKDIR /app
# Numeric, so the kubelet can check runAsNonRoot without reading /etc/passwd.
USER 10001:10001
EXPOSE 9464
# Exec form: the `outbox-farm` script is PID 1 and gets SIGTERM itself, which it turns into a
# graceful drain of its workers (a shell in between would swallow it). Its reaping loop waits
# for any child, so processes orphaned inside the container are reaped too. The base alone has
# no app to start: it prints the commands (`migrate` and `check` run from it as they are).
ENTRYPOINT ["outbox-farm"]
CMD ["--help"]
