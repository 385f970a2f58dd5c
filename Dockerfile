# syntax=docker/dockerfile:1
# outbox-relay: a static cgo binary (go-sqlite3) on distroless/static, which
# brings CA certificates and tzdata and runs as the non-root user 65532.
#   docker build --build-arg VERSION=1.0.0 --build-arg COMMIT=$(git rev-parse --short HEAD) -t outbox-relay .

ARG GO_VERSION=1.26

FROM golang:${GO_VERSION}-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG COMMIT=unknown
# The same recipe CI runs (scripts/build-static.sh): static linking, no
# dlopen, pure-Go DNS and user lookups, version and commit stamped.
RUN VERSION=${VERSION} COMMIT=${COMMIT} ./scripts/build-static.sh /out/outbox-relay \
 && /out/outbox-relay version \
 && mkdir -p /out/data

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG COMMIT=unknown
LABEL org.opencontainers.image.title="outbox-relay" \
      org.opencontainers.image.description="Relays a SQLite transactional outbox to NATS JetStream" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/outbox-relay /usr/local/bin/outbox-relay
# The shared database directory: mount the application's directory here
# (the directory, not the file, so -wal and -shm are shared too).
COPY --from=build --chown=65532:65532 /out/data /data
USER 65532:65532
VOLUME ["/data"]
# The default database.path, app.db, is then /data/app.db. (No ENV for
# config keys here: the environment would override a --config file.)
WORKDIR /data
EXPOSE 9108
# No shell in the image: the binary probes its own /healthz.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["/usr/local/bin/outbox-relay", "healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["run"]
