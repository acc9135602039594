# The Postbox service image: the `postbox` command (migrate, worker, relay, bridge, …).
#   docker build -t postbox .   |   docker run --rm postbox --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Install the package with the broker clients and HTTP its services use, and psycopg's libpq (the slim
# image has none); not the embedded PostgreSQL. The wheel carries sql/ and migrations/ as
# postbox/_data. Then drop the sources.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY sql ./sql
COPY migrations ./migrations
RUN pip install ".[all,binary,console]" && rm -rf /src

RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/postbox postbox
USER postbox
WORKDIR /home/postbox

ENTRYPOINT ["postbox"]
CMD ["--help"]
