# The kernelmode service (manager + Kernel Gateway) as an image, for docker-compose.yml:
# `kernelmode serve --sandbox docker` starts every kernel as a sibling container of
# kernelmode/kernel:latest (kernel-image/) through the host's Docker socket.
#
#   docker build --network host -t kernelmode/server:latest .
#   docker build --network host --build-arg BASE_IMAGE=kernelmode/base:bookworm ...   # no registry
#   make wheelhouse && docker build --network none --build-arg WHEELHOUSE=wheelhouse ...   # no index
#
# Same bases as kernel-image/Dockerfile: the official python:3.11-slim or the local Debian
# bookworm that scripts/docker-setup.sh makes. Works with the classic builder and BuildKit.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# WHEELHOUSE (optional): a directory of the build context holding every dependency as a wheel,
# plus pip and setuptools (scripts/wheelhouse.sh, `make wheelhouse`, writes wheelhouse/). Then
# nothing is fetched: no apt (the venv is made without ensurepip, pip comes from its wheel) and
# pip installs with --no-index. Empty (the default): the package index, as before.
ARG WHEELHOUSE=
# Its own layer, before the source: a code change reinstalls kernelmode, not its dependencies.
# (With WHEELHOUSE empty this copies pyproject.toml alone, unused.) A kernelmode wheel in it
# (`pip wheel . -w DIR` makes one) is dropped: it would go stale, /src is built below.
COPY pyproject.toml ${WHEELHOUSE} /tmp/wheelhouse/
RUN set -eux; \
    if [ -n "$WHEELHOUSE" ]; then \
        pip_whl=$(ls /tmp/wheelhouse/pip-*.whl 2>/dev/null | sort -V | tail -n1); \
        if [ -z "$pip_whl" ]; then \
            echo "WHEELHOUSE=$WHEELHOUSE holds no pip wheel: make it with scripts/wheelhouse.sh (make wheelhouse)" >&2; \
            exit 1; \
        fi; \
        python3 -m venv --without-pip /opt/kernelmode-venv; \
        rm -f /tmp/wheelhouse/kernelmode-*.whl; \
        /opt/kernelmode-venv/bin/python "$pip_whl/pip" install --no-index --find-links /tmp/wheelhouse \
            --no-cache-dir --disable-pip-version-check --no-input /tmp/wheelhouse/*.whl; \
    else \
        if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then \
            apt-get update; \
            DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv; \
            rm -rf /var/lib/apt/lists/*; \
        fi; \
        python3 -m venv /opt/kernelmode-venv; \
    fi
# build-ca.crt (optional, git-ignored): a CA bundle for pip, behind a TLS-intercepting proxy.
COPY pyproject.toml README.md build-ca.cr[t] /src/
COPY kernelmode /src/kernelmode
# kernelmode/sandbox/kernel-requirements.txt and ipython_kernel_config.json (package data) link
# to them.
COPY kernel-image/requirements.txt kernel-image/ipython_kernel_config.json /src/kernel-image/
RUN set -eux; \
    if [ -f /src/build-ca.crt ]; then export PIP_CERT=/src/build-ca.crt; fi; \
    if [ -n "$WHEELHOUSE" ]; then set -- --no-index --find-links /tmp/wheelhouse; fi; \
    /opt/kernelmode-venv/bin/pip install --no-cache-dir --disable-pip-version-check --no-input "$@" /src; \
    chmod -R a+rX,go-w /opt/kernelmode-venv

FROM ${BASE_IMAGE}
LABEL app=kernelmode \
      org.opencontainers.image.title="kernelmode" \
      org.opencontainers.image.description="kernelmode manager + Jupyter Kernel Gateway (Docker sandbox backend)"
COPY --from=build /opt/kernelmode-venv /opt/kernelmode-venv
# The gateway's configuration ships inside the installed package. DATA_DIR must be the same path
# on the host (see compose).
ENV PATH=/opt/kernelmode-venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    KERNELMODE_SERVER__DATA_DIR=/var/lib/kernelmode
# Runs as root: it hands each kernel's workspace and socket directory to that kernel's own uid
# (chown), and it talks to the Docker socket anyway (which is root on the host: see compose).
WORKDIR /var/lib/kernelmode
EXPOSE 8888
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8888/healthz', timeout=4)"]
CMD ["kernelmode", "serve", "--host", "0.0.0.0", "--port", "8888", "--sandbox", "docker"]
