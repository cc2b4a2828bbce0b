package console_test

import (
	"context"
	"encoding/base64"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The console's fixture, as the product's own console tests build it
// (internal/console/console_test.go): a console served on a fresh outbox
// database, and rows inserted in any state.

func TestMain(m *testing.M) { testenv.Main(m) }

const token = "s3cret-console-token"

type fixture struct {
	pool *pgxpool.Pool
	st   *store.Store
	tbl  store.Table
	srv  *httptest.Server
}

// setup migrates a fresh database and serves a console on it.
func setup(t *testing.T, o console.Options) *fixture {
	t.Helper()
	ctx := context.Background()
	env := testenv.Shared(t)
	dbURL := env.PG.CreateOutboxDatabase(t)
	tbl := testenv.OutboxTable
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st := store.New(pool, tbl, store.PolicyMark)
	c, err := console.New(o, "127.0.0.1:0", console.Sources{Store: st, Catalog: pool, Slot: "outbox_relay"})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	t.Cleanup(srv.Close)
	return &fixture{pool: pool, st: st, tbl: tbl, srv: srv}
}

// row is a row to insert, in any state, with the evidence a console shows.
type row struct {
	id, kind, state, lastError, payload string
	attempts                            int
	age                                 time.Duration // created this long ago
	expired                             bool          // its deadline passed
	streamSeq                           int64
}

func (f *fixture) insert(t *testing.T, rows ...row) {
	t.Helper()
	for _, r := range rows {
		if r.kind == "" {
			r.kind = "order.created"
		}
		if r.payload == "" {
			r.payload = `{"n":1}`
		}
		var lastErr, expires, seq, published any
		if r.lastError != "" {
			lastErr = r.lastError
		}
		if r.expired {
			expires = time.Now().Add(-time.Minute)
		}
		if r.streamSeq != 0 {
			seq, published = r.streamSeq, time.Now()
		}
		_, err := f.pool.Exec(context.Background(), `INSERT INTO `+f.tbl.String()+`
			(work_id, kind, payload, state, attempts, last_error, created_at, available_at, expires_at, stream_seq, published_at)
			VALUES ($1, $2, $3::jsonb, $4, $5, $6, clock_timestamp() - $7::bigint * interval '1 microsecond',
				clock_timestamp() - $7::bigint * interval '1 microsecond', $8, $9, $10)`,
			r.id, r.kind, r.payload, r.state, r.attempts, lastErr, r.age.Microseconds(), expires, seq, published)
		if err != nil {
			t.Fatalf("insert %q: %v", r.id, err)
		}
	}
}

func (f *fixture) state(t *testing.T, id string) string {
	t.Helper()
	var s string
	if err := f.pool.QueryRow(context.Background(), `SELECT state FROM `+f.tbl.String()+` WHERE work_id = $1`, id).Scan(&s); err != nil {
		t.Fatalf("state of %q: %v", id, err)
	}
	return s
}

func enc(id string) string { return base64.RawURLEncoding.EncodeToString([]byte(id)) }
