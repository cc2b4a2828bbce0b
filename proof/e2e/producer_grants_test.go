package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// TestProducerCannotForgeState: the producer role from `migrate
// --print-grants` may insert only the columns a producer sets. A row written
// in a state the relay owns (published with a made-up stream_seq, running
// under an endless lease, with a forged redrive audit) would never be
// delivered and could not be cancelled, so each of those inserts is refused,
// while everything package outbox and a hand-written INSERT legitimately do
// still works. The script is run over an install that had the old table-wide
// INSERT grant, and twice, and must leave the same narrow grant each time.
func TestProducerCannotForgeState(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	suffix := strings.TrimPrefix(uniqueName("forge"), "forge")
	relayRole, producerRole, operatorRole := "relay"+suffix, "producer"+suffix, "operator"+suffix
	producerID := pgx.Identifier{producerRole}.Sanitize()
	ctx := context.Background()
	t.Cleanup(func() {
		// Roles are cluster-wide. Registered before the database, so this
		// runs after the database is dropped: until then the roles' grants
		// in it keep DROP ROLE from succeeding.
		c, err := pgx.Connect(context.Background(), env.PG.URL("postgres"))
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		for _, r := range []string{relayRole, producerRole, operatorRole} {
			_, _ = c.Exec(context.Background(), `DROP OWNED BY `+pgx.Identifier{r}.Sanitize()+`; DROP ROLE IF EXISTS `+pgx.Identifier{r}.Sanitize())
		}
	})
	dbURL := env.PG.CreateDatabase(t)
	migrate(t, dbURL, "outbox_relay")

	owner := connectPG(t, dbURL)
	mayInsert := func(column string) bool {
		t.Helper()
		var ok bool
		if err := owner.QueryRow(ctx, `SELECT has_column_privilege($1, 'public.outbox', $2, 'INSERT')`, producerRole, column).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	// An install made with the old script: the producer may insert any column.
	if _, err := owner.Exec(ctx, `CREATE ROLE `+producerID+` LOGIN; GRANT USAGE ON SCHEMA public TO `+producerID+`; GRANT INSERT ON outbox TO `+producerID); err != nil {
		t.Fatal(err)
	}
	if !mayInsert("state") {
		t.Fatal("the old table-wide grant does not let the producer insert state: the test's premise is wrong")
	}

	code, grants, errOut := runCmd(t, nil, "migrate", "--print-grants", "--relay-role", relayRole,
		"--producer-role", producerRole, "--operator-role", operatorRole)
	if code != 0 {
		t.Fatalf("migrate --print-grants: exit %d: %s", code, errOut)
	}
	producerColumns := []string{"work_id", "kind", "subject", "payload", "headers", "available_at", "aggregate_type", "aggregate_id", "aggregate_seq", "expires_at"}
	relayColumns := []string{"state", "created_at", "attempts", "claim_generation", "claimed_by", "lease_until",
		"published_at", "stream_seq", "stream_name", "last_error", "redriven_at", "redriven_by", "redrive_reason"}
	for run := 1; run <= 2; run++ {
		if _, err := owner.Exec(ctx, grants); err != nil {
			t.Fatalf("run %d of the printed grants as the owner: %v\n%s", run, err, grants)
		}
		for _, c := range producerColumns {
			if !mayInsert(c) {
				t.Errorf("after run %d of the grants: the producer may not insert %s", run, c)
			}
		}
		for _, c := range relayColumns {
			if mayInsert(c) {
				t.Errorf("after run %d of the grants: the producer may still insert %s", run, c)
			}
		}
		var tableWide bool
		if err := owner.QueryRow(ctx, `SELECT has_table_privilege($1, 'public.outbox', 'INSERT')`, producerRole).Scan(&tableWide); err != nil {
			t.Fatal(err)
		}
		if tableWide {
			t.Errorf("after run %d of the grants: the producer still has INSERT on the whole table", run)
		}
	}

	producer := connectPG(t, strings.Replace(dbURL, "postgres://postgres@", "postgres://"+producerRole+"@", 1))
	forgeries := []struct{ name, sql string }{
		{"published with a stream_seq", `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq) VALUES ('forged-published', 'order', '{}', 'published', clock_timestamp(), 42)`},
		{"published, state alone", `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('forged-state', 'order', '{}', 'published')`},
		{"a redrive audit", `INSERT INTO outbox (work_id, kind, payload, redriven_at, redriven_by, redrive_reason) VALUES ('forged-redrive', 'order', '{}', clock_timestamp(), 'admin', 'approved')`},
		{"running under an endless lease", `INSERT INTO outbox (work_id, kind, payload, state, claimed_by, lease_until) VALUES ('forged-running', 'order', '{}', 'running', 'w', 'infinity')`},
		{"a claim generation", `INSERT INTO outbox (work_id, kind, payload, claim_generation) VALUES ('forged-generation', 'order', '{}', 1000000)`},
		{"attempts", `INSERT INTO outbox (work_id, kind, payload, attempts) VALUES ('forged-attempts', 'order', '{}', 99)`},
		{"last_error", `INSERT INTO outbox (work_id, kind, payload, last_error) VALUES ('forged-error', 'order', '{}', 'rejected: forged')`},
		{"created_at", `INSERT INTO outbox (work_id, kind, payload, created_at) VALUES ('forged-created', 'order', '{}', '2000-01-01')`},
		// Without a column list the values fill the table's columns in order,
		// so the sixth one is state.
		{"no column list", `INSERT INTO outbox VALUES ('forged-positional', 'order', NULL, '{}', NULL, 'published')`},
		{"an upsert", `INSERT INTO outbox (work_id, kind, payload) VALUES ('forged-upsert', 'order', '{}') ON CONFLICT (work_id) DO UPDATE SET state = 'published'`},
	}
	for _, f := range forgeries {
		_, err := producer.Exec(ctx, f.sql)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42501" {
			t.Errorf("producer inserts %s: got %v, want permission denied (42501)\n%s", f.name, err, f.sql)
		}
	}
	var forged int
	if err := owner.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id LIKE 'forged-%'`).Scan(&forged); err != nil {
		t.Fatal(err)
	}
	if forged != 0 {
		t.Errorf("%d forged rows in the table, want 0", forged)
	}

	// What a producer legitimately writes.
	for _, sql := range []string{
		`INSERT INTO outbox (work_id, kind, payload) VALUES ('plain-1', 'order', '{"n":1}')`,
		`INSERT INTO outbox (work_id, kind, subject, payload, headers, available_at)
		 VALUES ('delayed-1', 'order', 'orders.eu.created', '{"n":2}', '{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}', clock_timestamp() + interval '1 hour')`,
		`INSERT INTO outbox (work_id, kind, payload) VALUES ('plain-1', 'order', '{"n":1}') ON CONFLICT (work_id) DO NOTHING`,
	} {
		if _, err := producer.Exec(ctx, sql); err != nil {
			t.Errorf("producer: %v\n%s", err, sql)
		}
	}
	err := pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
		m := outbox.Message{WorkID: "enq-1", Kind: "order", Subject: "orders.enq", Payload: json.RawMessage(`{"n": 3}`),
			Headers:     map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
			AvailableAt: time.Now().Add(time.Hour)}
		if err := outbox.Enqueue(ctx, tx, m); err != nil {
			return err
		}
		// The repeat's comparison reads the stored kind, subject and payload
		// back, through the producer's column SELECT.
		if err := outbox.Enqueue(ctx, tx, m); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
			t.Errorf("repeat Enqueue as the producer: %v, want ErrAlreadyEnqueued", err)
		}
		m.Payload = json.RawMessage(`{"n":4}`)
		var conflict *outbox.ConflictError
		if err := outbox.Enqueue(ctx, tx, m); !errors.Is(err, outbox.ErrConflict) || !errors.As(err, &conflict) {
			t.Errorf("changed Enqueue as the producer: %v, want ErrConflict", err)
		} else if conflict.StoredPayload != `{"n": 3}` || conflict.StoredSubject != "orders.enq" {
			t.Errorf("conflict as the producer: stored subject %q, payload %q; want orders.enq, {\"n\": 3}", conflict.StoredSubject, conflict.StoredPayload)
		}
		res, err := outbox.EnqueueBatch(ctx, tx, []outbox.Message{
			{WorkID: "enq-1", Kind: "order", Subject: "orders.enq", Payload: json.RawMessage(`{"n":3}`)},
			{WorkID: "enq-2", Kind: "order", Payload: json.RawMessage(`{"n":5}`)},
			{WorkID: "plain-1", Kind: "other", Payload: json.RawMessage(`{"n":1}`)},
		})
		if want := []outbox.Result{outbox.AlreadyEnqueued, outbox.Inserted, outbox.Conflicted}; !errors.Is(err, outbox.ErrConflict) || len(res) != 3 || res[0] != want[0] || res[1] != want[1] || res[2] != want[2] {
			t.Errorf("EnqueueBatch as the producer: %v, %v; want %v and ErrConflict", res, err, want)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Enqueue as the producer: %v", err)
	}

	// Every row the producer wrote starts as the relay expects a new row to.
	rows, err := owner.Query(ctx, `SELECT work_id, state, attempts, claim_generation, claimed_by IS NULL AND lease_until IS NULL
			AND published_at IS NULL AND stream_seq IS NULL AND last_error IS NULL AND redriven_by IS NULL,
			available_at > clock_timestamp() + interval '30 minutes'
		FROM outbox ORDER BY work_id`)
	if err != nil {
		t.Fatal(err)
	}
	type stored struct {
		state          string
		attempts       int
		generation     int64
		clean, delayed bool
	}
	got := map[string]stored{}
	for rows.Next() {
		var id string
		var s stored
		if err := rows.Scan(&id, &s.state, &s.attempts, &s.generation, &s.clean, &s.delayed); err != nil {
			t.Fatal(err)
		}
		got[id] = s
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"plain-1": false, "delayed-1": true, "enq-1": true, "enq-2": false}
	if len(got) != len(want) {
		t.Errorf("rows %v, want %v", got, want)
	}
	for id, delayed := range want {
		s, ok := got[id]
		if !ok || s.state != "ready" || s.attempts != 0 || s.generation != 0 || !s.clean || s.delayed != delayed {
			t.Errorf("%s: %+v (found %t), want a fresh ready row, delayed %t", id, s, ok, delayed)
		}
	}
}
