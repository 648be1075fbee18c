# pdserve image: one image for every role; the command picks it (`pdserve gateway|prefill|decode`).
#   docker build -t pdserve .                                    # CPU torch
#   docker build -t pdserve --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /app

# g++: the CPU linear kernel (kernels/csrc) is compiled on first use; Triton needs it on GPUs too.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# torch first, from the chosen wheel index, in its own layer (it is most of the image).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

COPY . .
RUN pip install -e . && python -m proto.build

ENTRYPOINT ["pdserve"]
CMD ["--help"]
