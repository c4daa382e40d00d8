# kernel.extra_requirements baked into the kernel image: a layer on top of the image that
# kernel-image/Dockerfile builds (scripts/docker-setup.sh, step 5, builds it only when the list is
# not empty, so the plain image and its build hash stay as they are). Wheels only, like the image,
# with the kernel's own requirements as constraints: a team's package adds to the kernel, it
# never replaces ipykernel or its stack. (No chmod -R here: it would copy the whole venv into
# this layer; pip as root with umask 022 leaves the new files readable by every uid.)
#
#   docker build -f scripts/kernel-extras.Dockerfile --build-arg KERNEL_IMAGE=kernelmode/kernel:no-extras \
#     -t kernelmode/kernel:latest CONTEXT   # CONTEXT: requirements.txt, extra-requirements.txt
ARG KERNEL_IMAGE=kernelmode/kernel:no-extras
FROM ${KERNEL_IMAGE}
# The index to install from (packages.index_url when set), and the CA bundle pip trusts.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
USER root
COPY requirements.txt extra-requirements.txt build-ca.cr[t] /tmp/extra/
RUN set -eux; \
    if [ -f /tmp/extra/build-ca.crt ]; then export PIP_CERT=/tmp/extra/build-ca.crt; fi; \
    /opt/kernel-venv/bin/pip install --no-cache-dir --disable-pip-version-check --no-input \
        --only-binary=:all: -c /tmp/extra/requirements.txt -r /tmp/extra/extra-requirements.txt; \
    rm -rf /tmp/extra
USER 1000:1000
