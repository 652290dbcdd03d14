# Builds vescale on torch 2.13 with scripts/install.sh (what `bash scripts/test.sh` installs) and
# runs the test suite. Pass pip's index with --build-arg PIP_INDEX_URL=<index>, and an index for
# torch's CPU build with --build-arg VESCALE_TORCH_INDEX=https://download.pytorch.org/whl/cpu.
FROM python:3.11-slim
ARG PIP_INDEX_URL
ARG VESCALE_TORCH_INDEX
# g++ builds the C++ plug-in kernel the tests load with torch.utils.cpp_extension
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /vescale
COPY . .
RUN PIP_NO_CACHE_DIR=1 bash scripts/install.sh test
CMD ["bash", "scripts/test.sh", "-q"]
