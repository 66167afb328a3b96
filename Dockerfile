# diloco-node in a container: `docker build -t diloco-node .`, then for example
#   docker run --rm -it --network host diloco-node start --listen /ip4/0.0.0.0/tcp/31337
#   docker run --rm -it --network host diloco-node join --initial-peers /ip4/HOST/tcp/31337/p2p/...
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/diloco-node

# The CPU build of PyTorch keeps the image small; use a CUDA base and wheel for GPUs.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.3"

COPY pyproject.toml README.md ./
COPY diloco ./diloco
RUN pip install .

ENTRYPOINT ["diloco-node"]
CMD ["--help"]
