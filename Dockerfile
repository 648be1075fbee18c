# pdserve image: one image for every role; the command picks it (`pdserve gateway|prefill|decode`).
#   docker build -t pdserve .                                                        # CPU torch
#   docker build -t pdserve:cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple .  # CUDA 13.0
# torch 2.13.0 on PyPI is the CUDA 13.0 build (cuda-toolkit 13.0 wheels, NCCL, triton 3.7.1): it
# needs an NVIDIA driver >= 580 on the host and nothing CUDA in the image. For a CUDA 12 driver
# point TORCH_INDEX_URL at a CUDA 12 index of download.pytorch.org (e.g. .../whl/cu128).
# The nixl package brings UCX for CUDA 12 and 13 and picks the one matching torch at import.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Used only where the torch build brings no triton of its own (CPU torch); the Makefile's pin.
ARG TRITON_VERSION=3.9.0

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app

# g++: the CPU linear kernel (pdkernels/csrc) is compiled on first use; Triton needs it on GPUs too.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen wheel index, in its own layer (it is most of the image). A CUDA
# torch pins the triton it was built with; the project's install below is held to both.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
    && (pip show triton >/dev/null 2>&1 || pip install "triton==${TRITON_VERSION}") \
    && pip freeze | grep -i -E '^(torch|triton)==' > /etc/pdserve-constraints.txt \
    && cat /etc/pdserve-constraints.txt

COPY . .
RUN pip install -c /etc/pdserve-constraints.txt -e . && python -m proto.build

ENTRYPOINT ["pdserve"]
CMD ["--help"]
