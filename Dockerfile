# Builds vescale on torch 2.13.0 and runs the test suite.
# For the CPU-only wheel pass your CPU wheel index: --build-arg PIP_INDEX_URL=<index>.
FROM python:3.11-slim
ARG PIP_INDEX_URL
# g++ builds the C++ plug-in kernel the tests load with torch.utils.cpp_extension
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /vescale
COPY . .
RUN python -m pip install --no-cache-dir torch==2.13.0 \
 && python -m pip install --no-cache-dir -e '.[test]'
CMD ["bash", "scripts/test.sh", "-q"]
