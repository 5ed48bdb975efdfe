# kvstore image: the library, the CLI and (later) the store process and the vLLM connector.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY tiers ./tiers
COPY connector ./connector
RUN pip install --no-cache-dir . \
 && mkdir -p /data/ssd
ENTRYPOINT ["kvstore"]
CMD ["demo", "--dir", "/data/ssd"]
