#!/usr/bin/env bash
# go-test-split.sh N PACKAGE [go test flags...]
#
# Runs one package's top-level tests in N go test processes at once, each
# with a share of them (round-robin over `go test -list`, which lists them in
# source order, so each process gets slow and quick ones), and prints each
# process's output whole when it ends. Exits non-zero when any failed.
#
# Why: internal/relay's tests run one after another (most kill, restart or
# cut the servers they share), about 500 s on the 2-core CI machine, and
# mostly wait on those servers. Each go test process starts servers of its
# own (testenv.Shared), so two processes cannot disturb each other, and the
# package takes about half as long.
#
# A -run in the flags is not allowed (the split writes its own); -skip is
# passed on, and a skipped test counts for no process.
set -uo pipefail

n="$1"
pkg="$2"
shift 2
go="${GO:-go}"

for a in "$@"; do
	case "$a" in
	-run | -run=*) echo "go-test-split: -run is written by the split; use -skip" >&2; exit 2 ;;
	esac
done

# The same build flags as the run, so the test binary the list compiles is
# the one the run reuses from the build cache.
build=()
skip=""
prev=""
for a in "$@"; do
	case "$a" in
	-race) build+=("$a") ;;
	-skip=*) skip="${a#-skip=}" ;;
	esac
	if [[ "$prev" == "-skip" ]]; then skip="$a"; fi
	prev="$a"
done

names=$("$go" test "${build[@]}" -list '^Test' "$pkg" | grep '^Test') || {
	echo "go-test-split: could not list the tests of $pkg" >&2
	exit 1
}
if [[ -n "$skip" ]]; then
	names=$(grep -Ev -- "$skip" <<<"$names" || true)
fi

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
pids=()
for ((i = 0; i < n; i++)); do
	share=$(awk -v n="$n" -v i="$i" 'NR % n == i' <<<"$names" | paste -sd'|')
	if [[ -z "$share" ]]; then
		continue
	fi
	(
		start=$(date +%s)
		if "$go" test "$@" -run "^(${share})\$" "$pkg" >"$dir/$i.out" 2>&1; then
			echo "--- $pkg share $((i + 1))/$n: ok in $(($(date +%s) - start))s" >>"$dir/$i.out"
		else
			echo "--- $pkg share $((i + 1))/$n: FAILED after $(($(date +%s) - start))s" >>"$dir/$i.out"
			exit 1
		fi
	) &
	pids+=("$!:$i")
done

failed=0
for p in "${pids[@]}"; do
	pid="${p%%:*}"
	i="${p##*:}"
	wait "$pid" || failed=1
	cat "$dir/$i.out"
done
exit "$failed"
