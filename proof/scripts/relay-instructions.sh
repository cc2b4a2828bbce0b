#!/usr/bin/env bash
# relay-instructions.sh RELAY_BIN ROWS [outbox-bench flags...]
#
# Counts the instructions the relay executes to drain ROWS rows: runs
# outbox-bench with the relay under valgrind's cachegrind (instruction
# counts only) and prints the count of the relay's drain run. Instruction
# counts repeat where timings on a shared 2-core machine do not; run it at
# two sizes and divide the difference by the difference in rows to get
# instructions per message without the start-up (docs/benchmarks-second-round.md):
#
#   proof/scripts/relay-instructions.sh /tmp/outbox-relay 5000  -rows-per-tx 100 -cases cdc-backlog
#   proof/scripts/relay-instructions.sh /tmp/outbox-relay 15000 -rows-per-tx 100 -cases cdc-backlog
#
# cachegrind, not callgrind: callgrind's signal handling aborts on the Go
# runtime's signals. GODEBUG=asyncpreemptoff=1 keeps the runtime from
# preempting with signals, which valgrind also mishandles.
set -euo pipefail
bin=$(realpath "$1"); rows=$2; shift 2
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install valgrind" >&2; exit 1; }
dir=$(mktemp -d)
wrap=$dir/relay
cat >"$wrap" <<WRAP
#!/usr/bin/env bash
export GODEBUG=asyncpreemptoff=1
exec valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=$dir/cg.%p.out "$bin" "\$@" 2>>$dir/valgrind.log
WRAP
chmod +x "$wrap"
cd "$(dirname "$0")/.."
go run ./cmd/outbox-bench -relay-bin "$wrap" -rows "$rows" -rounds 1 "$@" >"$dir/bench.txt" 2>&1 ||
  { echo "outbox-bench failed; see $dir/bench.txt" >&2; exit 1; }
best=0
for f in "$dir"/cg.*.out; do
  if grep -q '^cmd:.* run ' "$f"; then
    ir=$(awk '/^summary:/ {print $2}' "$f")
    [ "${ir:-0}" -gt "$best" ] && best=$ir
  fi
done
echo "relay $bin, $rows rows: $best instructions (cachegrind output in $dir)"
