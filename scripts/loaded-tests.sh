#!/bin/sh
# Runs the test suite (go test -race ./...) RUNS times in a row while a
# busy loop keeps every core busy, and stops at the first failure: a test
# that fails under load is a defect (a race or a margin), not bad luck.
#   RUNS=5 scripts/loaded-tests.sh
set -eu
runs=${RUNS:-5}
go build -o "${TMPDIR:-/tmp}/outbox-relay-busy" ./scripts/busy
"${TMPDIR:-/tmp}/outbox-relay-busy" -for 2h &
busy=$!
trap 'kill $busy 2>/dev/null || true' EXIT INT TERM
i=1
while [ "$i" -le "$runs" ]; do
  start=$(date +%s)
  # Under the busy loop the packages take about 1.7 times as long: the
  # cmd package's 340 s became 575 s, near go test's 10-minute default.
  go test -race -count=1 -timeout 30m ./...
  echo "loaded run $i of $runs passed in $(( $(date +%s) - start )) s"
  i=$((i + 1))
done
