# An env image built the way a foreign one is (GraphJin's, for instance), for docker/e2e.sh: its
# entrypoint is the env's own program (not python, not a shell), its arguments come from the
# compose file's ENV_COMMAND, it runs as a non-root user, and it carries no health-check tooling:
# no python, curl or wget on its PATH. It serves refenv's step contract, installed in a venv whose
# interpreter is a private copy, so nothing a compose health check could call is left on the PATH.
#   docker build -f docker/foreign-env.Dockerfile -t stepenv-foreign:local .
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY rollout_service ./rollout_service
COPY refenv ./refenv
# hadolint ignore=DL3013
RUN python3 -m venv --copies /opt/stepenv \
 && /opt/stepenv/bin/pip install --no-compile "/src[server]" \
 && rm -rf /src \
 && useradd --no-create-home --uid 10002 stepenv \
 && rm -f /usr/bin/python* /usr/local/bin/python* /usr/bin/pip* /usr/local/bin/pip* /usr/bin/curl /usr/bin/wget

ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /
USER 10002
EXPOSE 8090
ENTRYPOINT ["/opt/stepenv/bin/refenv"]
CMD ["serve", "--step", "--pool", "2", "--listen", "0.0.0.0:8090"]
