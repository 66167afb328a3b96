# syntax=docker/dockerfile:1
# diloco-node in a container: `docker build -t diloco-node .`, then for example
#   docker run --rm -it --network host diloco-node start --listen /ip4/0.0.0.0/tcp/31337
#   docker run --rm -it --network host diloco-node join --initial-peers /ip4/HOST/tcp/31337/p2p/...
# scripts/container_check.sh builds it with podman on a local Debian base and runs a swarm.
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
# Where pip finds torch: the CPU build from PyTorch's index keeps the image small (use a
# CUDA base and wheel for GPUs). A build that brings its own wheel mounts it and sets e.g.
# TORCH_FROM="--find-links /wheels" TORCH="torch==2.13.0+cpu".
ARG TORCH_FROM="--index-url https://download.pytorch.org/whl/cpu"
ARG TORCH="torch>=2.3"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
# The optional secret "ca" is a CA bundle for an index behind a TLS-inspecting proxy.
RUN --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install ${TORCH_FROM} "${TORCH}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY diloco ./diloco
RUN --mount=type=secret,id=ca \
    if [ -f /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    pip install . && pip uninstall -y -q pip
# Slimmer: headers and CMake files serve extensions built against torch, test/ and bin/
# hold its C++ test programs (bin/torch_shm_manager excepted: torch needs it); a node
# needs none of them (about 200 MB). Bytecode stays: without it every container start
# would compile torch's modules again.
RUN cd /opt/venv/lib/python3*/site-packages/torch && rm -rf include share test \
    && find bin -type f ! -name torch_shm_manager -delete

FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
ENTRYPOINT ["diloco-node"]
CMD ["--help"]
