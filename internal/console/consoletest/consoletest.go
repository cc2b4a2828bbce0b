// Package consoletest is the console's test fixture, shared by the console's
// own tests and the browser test in the proof module: a console served on a
// fresh outbox database, and rows inserted in any state.
package consoletest

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

// Token is the console token the tests use.
const Token = "s3cret-console-token"

// Fixture is a console served on a fresh outbox database.
type Fixture struct {
	Console *console.Console
	Pool    *pgxpool.Pool
	Store   *store.Store
	Table   store.Table
	Server  *httptest.Server
}

// Setup migrates a fresh database and serves a console with o on it.
func Setup(t *testing.T, o console.Options) *Fixture {
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
	return &Fixture{Console: c, Pool: pool, Store: st, Table: tbl, Server: srv}
}

// Row is a row to insert, in any state, with the evidence a console shows.
type Row struct {
	ID, Kind, State, LastError, Payload string
	Attempts                            int
	Age                                 time.Duration // created this long ago
	Expired                             bool          // its deadline passed
	StreamSeq                           int64
}

// Insert inserts rows as given (kind and payload defaulted).
func (f *Fixture) Insert(t *testing.T, rows ...Row) {
	t.Helper()
	for _, r := range rows {
		if r.Kind == "" {
			r.Kind = "order.created"
		}
		if r.Payload == "" {
			r.Payload = `{"n":1}`
		}
		var lastErr, expires, seq, published any
		if r.LastError != "" {
			lastErr = r.LastError
		}
		if r.Expired {
			expires = time.Now().Add(-time.Minute)
		}
		if r.StreamSeq != 0 {
			seq, published = r.StreamSeq, time.Now()
		}
		_, err := f.Pool.Exec(context.Background(), `INSERT INTO `+f.Table.String()+`
			(work_id, kind, payload, state, attempts, last_error, created_at, available_at, expires_at, stream_seq, published_at)
			VALUES ($1, $2, $3::jsonb, $4, $5, $6, clock_timestamp() - $7::bigint * interval '1 microsecond',
				clock_timestamp() - $7::bigint * interval '1 microsecond', $8, $9, $10)`,
			r.ID, r.Kind, r.Payload, r.State, r.Attempts, lastErr, r.Age.Microseconds(), expires, seq, published)
		if err != nil {
			t.Fatalf("insert %q: %v", r.ID, err)
		}
	}
}

// State is the row's state.
func (f *Fixture) State(t *testing.T, id string) string {
	t.Helper()
	var s string
	if err := f.Pool.QueryRow(context.Background(), `SELECT state FROM `+f.Table.String()+` WHERE work_id = $1`, id).Scan(&s); err != nil {
		t.Fatalf("state of %q: %v", id, err)
	}
	return s
}

// Enc is a work ID as the console's row links carry it.
func Enc(id string) string { return base64.RawURLEncoding.EncodeToString([]byte(id)) }
