#!/bin/sh
# Builds a statically linked outbox-relay: cgo (go-sqlite3) against glibc's
# static libc, no dlopen (sqlite_omit_load_extension), pure-Go DNS and user
# lookups (netgo, osusergo), stripped. The Dockerfile and CI both use it.
#   VERSION=1.2.3 COMMIT=abc123 scripts/build-static.sh /out/outbox-relay
set -eu
out=${1:-bin/outbox-relay}
version=${VERSION:-dev}
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
CGO_ENABLED=1 go build -trimpath \
  -tags 'sqlite_omit_load_extension,netgo,osusergo' \
  -ldflags "-linkmode external -extldflags '-static' -s -w -X main.version=${version} -X main.commit=${commit}" \
  -o "$out" ./cmd/outbox-relay
