# Rollway: one process, SQLite in /data by default. Listening on 0.0.0.0 needs an admin token:
#   docker run -p 8080:8080 -e ROLLWAY_ADMIN_TOKEN=... -v rollway-data:/data rollway
# Clients that reach it by a host name need ROLLWAY_PUBLIC_URL or ROLLWAY_ALLOWED_HOSTS (docs/deployment.md).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY store ./store
COPY gateway ./gateway
COPY admin ./admin
COPY rollway ./rollway
RUN pip install '.[server]' \
    && useradd --system --create-home --uid 10001 rollway \
    && mkdir -p /data && chown rollway:rollway /data

USER rollway
WORKDIR /data
ENV ROLLWAY_DATABASE_URL=sqlite:////data/rollway.db
VOLUME ["/data"]
EXPOSE 8080

HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"

CMD ["rollway", "serve", "--host", "0.0.0.0", "--port", "8080"]
