package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// TestLeastPrivilegeRoles runs the relay as the role `migrate --print-grants`
// creates, and the producer as its producer role: rows committed before the
// slot existed (the backfill) and after are all delivered, and each role is
// refused what it was not granted.
func TestLeastPrivilegeRoles(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	slot, publication := uniqueName("e2e_roles"), "outbox_relay"
	suffix := strings.TrimPrefix(slot, "e2e_roles")
	relayRole, producerRole, operatorRole := "relay"+suffix, "producer"+suffix, "operator"+suffix
	migrate(t, dbURL, publication)

	code, grants, errOut := runCmd(t, nil, "migrate", "--print-grants", "--relay-role", relayRole,
		"--producer-role", producerRole, "--operator-role", operatorRole)
	if code != 0 {
		t.Fatalf("migrate --print-grants: exit %d: %s", code, errOut)
	}
	owner := connectPG(t, dbURL)
	ctx := context.Background()
	for range 2 { // a second run must be harmless
		if _, err := owner.Exec(ctx, grants); err != nil {
			t.Fatalf("run the printed grants as the owner: %v\n%s", err, grants)
		}
	}
	// PostgreSQL 16+: the relay's role may write running-transactions
	// records (the slot's restart position, docs/deploy.md), and not
	// because everyone may: the function is superuser-only unless granted.
	if v := env.PG.Version(); v >= 16 {
		for role, want := range map[string]bool{relayRole: true, producerRole: false} {
			var got bool
			if err := owner.QueryRow(ctx, `SELECT has_function_privilege($1, 'pg_catalog.pg_log_standby_snapshot()', 'EXECUTE')`, role).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Fatalf("PostgreSQL %d: %s may execute pg_log_standby_snapshot(): %v, want %v", v, role, got, want)
			}
		}
	}
	t.Cleanup(func() {
		// Roles are cluster-wide: drop them once the database is gone.
		c, err := pgx.Connect(context.Background(), env.PG.URL("postgres"))
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		for _, r := range []string{relayRole, producerRole, operatorRole} {
			_, _ = c.Exec(context.Background(), `DROP OWNED BY `+pgx.Identifier{r}.Sanitize()+`; DROP ROLE IF EXISTS `+pgx.Identifier{r}.Sanitize())
		}
	})
	asRole := func(role string) string {
		return strings.Replace(dbURL, "postgres://postgres@", "postgres://"+role+"@", 1)
	}
	producer := connectPG(t, asRole(producerRole))
	enqueue := func(prefix string, n int) []string {
		var ids []string
		for i := range n {
			id := fmt.Sprintf("%s-%d", prefix, i)
			err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
				return outbox.Enqueue(ctx, tx, outbox.Message{WorkID: id, Kind: "order", Payload: json.RawMessage(fmt.Sprintf(`{"n":%d}`, i))})
			})
			if err != nil {
				t.Fatalf("enqueue %s as %s: %v", id, producerRole, err)
			}
			ids = append(ids, id)
		}
		// Enqueueing the same row again is recognised, which needs the
		// producer's column SELECT.
		err := outbox.Enqueue(ctx, producer, outbox.Message{WorkID: ids[0], Kind: "order", Payload: json.RawMessage(`{"n":0}`)})
		if !errors.Is(err, outbox.ErrAlreadyEnqueued) {
			t.Fatalf("repeat enqueue as %s: %v, want ErrAlreadyEnqueued", producerRole, err)
		}
		return ids
	}
	before := enqueue("before", 20)

	r := newRelay(t, runArgs(asRole(relayRole), env.NATS.URL(), stream, prefix, slot, publication, "--poll-interval", "100ms")...)
	r.start()
	waitSlot(t, owner, slot, true, 60*time.Second)
	// The slot shows as active while it is still being created; rows
	// committed before its consistent point belong to the backfill.
	testenv.WaitFor(t, 60*time.Second, "the backfill recorded", func() (bool, error) {
		var done bool
		err := owner.QueryRow(ctx, `SELECT count(*) = 1 FROM outbox_slots WHERE slot_name = $1 AND NOT backfill_pending AND backfilled_rows IS NOT NULL`, slot).Scan(&done)
		return done, err
	})
	after := enqueue("after", 20)
	total := len(before) + len(after)
	testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("%d rows published", total), func() (bool, error) {
		r.requireRunning()
		var n int
		err := owner.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
		return n == total, err
	})
	ids := map[string]int{}
	for _, m := range readStream(t, connectNATS(t, env.NATS.URL()), stream) {
		ids[m.header.Get(jetstream.MsgIDHeader)]++
	}
	for _, id := range append(append([]string{}, before...), after...) {
		if ids[id] != 1 {
			t.Errorf("%s stored %d times, want 1", id, ids[id])
		}
	}

	// Each role is refused what it was not granted.
	refused := func(who string, conn *pgx.Conn, sql string) {
		t.Helper()
		_, err := conn.Exec(ctx, sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("%s: %s: got %v, want permission denied (42501)", who, sql, err)
		}
	}
	relayConn := connectPG(t, asRole(relayRole))
	refused(relayRole, relayConn, `INSERT INTO outbox (work_id, kind, payload) VALUES ('forged', 'x', '{}')`)
	refused(relayRole, relayConn, `INSERT INTO outbox_redrives (work_id, action, by, reason, previous_state, previous_attempts, previous_generation) VALUES ('x', 'redrive', 'me', 'r', 'failed', 0, 0)`)
	refused(producerRole, producer, `UPDATE outbox SET state = 'published'`)
	refused(producerRole, producer, `SELECT state FROM outbox`)
	operator := connectPG(t, asRole(operatorRole))
	refused(operatorRole, operator, `INSERT INTO outbox (work_id, kind, payload) VALUES ('forged', 'x', '{}')`)
	var backfilled int64
	if err := owner.QueryRow(ctx, `SELECT backfilled_rows FROM outbox_slots WHERE slot_name = $1`, slot).Scan(&backfilled); err != nil {
		t.Fatal(err)
	}
	t.Logf("figures: rows=%d (backfilled %d) as roles %s / %s", total, backfilled, relayRole, producerRole)
	if backfilled != int64(len(before)) {
		t.Errorf("backfilled %d rows as %s, want %d", backfilled, relayRole, len(before))
	}

	// Without its grant on outbox_slots the relay refuses to start and
	// names the grant, instead of failing later in a retry loop.
	if _, err := r.terminate(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Exec(ctx, `REVOKE INSERT ON outbox_slots FROM `+pgx.Identifier{relayRole}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	code, _, errOut = runCmd(t, nil, append([]string{"run"}, runArgs(asRole(relayRole), env.NATS.URL(), stream, prefix, slot, publication)...)...)
	if want := "GRANT SELECT, INSERT, UPDATE ON \"public\".\"outbox_slots\" TO " + relayRole; code == 0 || !strings.Contains(errOut, want) {
		t.Errorf("relay without its outbox_slots grant: exit %d, stderr %q; want non-zero and %q", code, errOut, want)
	}
}

// TestLibpqEnvironment: with no --database-url the standard libpq variables
// (PGHOST, PGPORT, PGUSER, PGDATABASE, ...) choose the database, for the
// pool and the replication connection alike.
func TestLibpqEnvironment(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	dbName := dbURL[strings.LastIndex(dbURL, "/")+1 : strings.Index(dbURL, "?")]
	stream, prefix := env.StreamName(t)
	slot := uniqueName("e2e_pgenv")
	pgEnv := []string{"PGHOST=127.0.0.1", fmt.Sprintf("PGPORT=%d", env.PG.Port()), "PGUSER=postgres", "PGDATABASE=" + dbName, "PGSSLMODE=disable"}
	if code, out, errOut := runCmd(t, pgEnv, "migrate"); code != 0 {
		t.Fatalf("migrate from PG* variables: exit %d\n%s%s", code, out, errOut)
	}
	conn := connectPG(t, dbURL)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('pgenv-1', 'order', '{}')`); err != nil {
		t.Fatal(err)
	}
	args := []string{"--nats-url", env.NATS.URL(), "--slot", slot, "--stream", stream, "--subject-prefix", prefix}
	r := newRelay(t, args...)
	r.cmdEnv = pgEnv
	r.start()
	testenv.WaitFor(t, 60*time.Second, "the row published", func() (bool, error) {
		r.requireRunning()
		var state string
		err := conn.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'pgenv-1'`).Scan(&state)
		return state == "published", err
	})
	code, out, errOut := runCmd(t, pgEnv, "status", "--slot", slot, "--json")
	if code != 0 || !strings.Contains(out, `"published": 1`) {
		t.Errorf("status from PG* variables: exit %d\n%s%s", code, out, errOut)
	}
}
