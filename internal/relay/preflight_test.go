package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// G11: what no retry can fix fails at start, saying what to do.
func TestPreflightErrors(t *testing.T) {
	env := testenv.Shared(t)
	run := func(t *testing.T, h *harness) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		return app.Run(ctx, h.opts, zerolog.Nop())
	}

	t.Run("wal_level", func(t *testing.T) {
		pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: map[string]string{"wal_level": "replica"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pg.Close)
		stream, prefix := env.StreamName(t)
		h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
		err = run(t, h)
		if err == nil || !strings.Contains(err.Error(), "wal_level") || !strings.Contains(err.Error(), "ALTER SYSTEM SET wal_level = logical") {
			t.Fatalf("err = %v, want one naming wal_level and the fix", err)
		}
	})

	t.Run("no REPLICATION attribute", func(t *testing.T) {
		s := sharedSetup(t)
		h := newHarness(t, s)
		h.exec(`DO $$ BEGIN CREATE ROLE app_no_repl LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$`)
		h.exec(`GRANT SELECT, UPDATE, DELETE ON outbox TO app_no_repl`)
		h.opts.DatabaseURL = strings.Replace(s.dbURL, "postgres@", "app_no_repl@", 1)
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "REPLICATION") || !strings.Contains(err.Error(), "ALTER ROLE") {
			t.Fatalf("err = %v, want one naming the REPLICATION attribute and the fix", err)
		}
	})

	t.Run("dropped column", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.exec(`ALTER TABLE outbox DROP COLUMN headers`)
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "headers") || !strings.Contains(err.Error(), "migrate") {
			t.Fatalf("err = %v, want one naming the missing column and migrate", err)
		}
	})

	t.Run("publication covering other tables", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.exec(`CREATE TABLE other (id int)`)
		h.exec(`CREATE PUBLICATION outbox_relay FOR TABLE outbox, other WITH (publish = 'insert')`)
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "also publishes public.other") || !strings.Contains(err.Error(), "ALTER PUBLICATION") {
			t.Fatalf("err = %v, want one naming the other table and the fix", err)
		}
	})

	// A row filter or column list of someone else's would leave ready rows
	// that nothing ever publishes.
	t.Run("publication filtering other rows", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.exec(`CREATE PUBLICATION outbox_relay FOR TABLE outbox WHERE (kind <> 'audit') WITH (publish = 'insert')`)
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "WHERE (kind <> 'audit'::text)") ||
			!strings.Contains(err.Error(), `ALTER PUBLICATION "outbox_relay" SET TABLE "public"."outbox" WHERE (state = 'ready')`) {
			t.Fatalf("err = %v, want one naming the filter and the fix", err)
		}
	})

	t.Run("publication of updates", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.exec(`CREATE PUBLICATION outbox_relay FOR TABLE outbox WITH (publish = 'insert, update')`)
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "must publish inserts only") || !strings.Contains(err.Error(), `SET (publish = 'insert')`) {
			t.Fatalf("err = %v, want one saying inserts only and the fix", err)
		}
	})

	t.Run("publication of some columns", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.exec(`CREATE PUBLICATION outbox_relay FOR TABLE outbox (work_id, kind, state) WITH (publish = 'insert')`)
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "only some columns") || !strings.Contains(err.Error(), "SET TABLE") {
			t.Fatalf("err = %v, want one naming the column list and the fix", err)
		}
	})

	// Two relays for different tables on one slot: the second refuses to
	// start, since streaming the first one's slot would confirm past rows
	// it never published.
	t.Run("slot of another table", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.start()
		h.insertRows("a", 3, 3)
		h.waitPublished(3, 20*time.Second)

		other := store.Table{Schema: "public", Name: "other_outbox"}
		conn, err := pgx.Connect(context.Background(), h.dbURL)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(context.Background())
		if _, err := schema.Migrate(context.Background(), conn, other); err != nil {
			t.Fatal(err)
		}
		b := h.opts
		b.Table, b.Publication, b.Started = other, "other_pub", nil
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		err = app.Run(ctx, b, zerolog.Nop())
		if err == nil || !strings.Contains(err.Error(), "slot "+h.opts.Slot+" exists but was not created for table public.other_outbox") || !strings.Contains(err.Error(), "--slot") {
			t.Fatalf("err = %v, want one saying the slot belongs to another table", err)
		}
		// The first relay is unharmed.
		h.insertRows("b", 3, 3)
		h.waitPublished(6, 20*time.Second)
	})

	t.Run("bad slot name", func(t *testing.T) {
		h := newHarness(t, sharedSetup(t))
		h.opts.Slot = "Outbox-Slot"
		err := run(t, h)
		if err == nil || !strings.Contains(err.Error(), "--slot") {
			t.Fatalf("err = %v, want one naming --slot", err)
		}
	})
}
