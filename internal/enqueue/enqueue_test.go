package enqueue_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/enqueue"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func newPool(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestEnqueueLayoutOf: the producer's layout lookup says whether the table
// is partitioned and what its payload column is, for every
// --payload-type, plain and partitioned, on a name that needs quoting; a
// missing table reads as jsonb and is not kept.
func TestEnqueueLayoutOf(t *testing.T) {
	t.Parallel()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	pool := newPool(t, url)
	ctx := context.Background()
	missing, err := store.ParseTable(`Sales-Ops.later`)
	if err != nil {
		t.Fatal(err)
	}
	if l, err := enqueue.LayoutOf(ctx, pool, missing); err != nil || l != (enqueue.Layout{PayloadType: "jsonb"}) {
		t.Errorf("missing table: %+v, %v", l, err)
	}
	for _, ptype := range schema.PayloadTypes {
		for _, part := range []time.Duration{0, time.Hour} {
			tbl, err := store.ParseTable(fmt.Sprintf(`Sales-Ops.Out "%s" %v`, ptype, part > 0))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PayloadType: ptype, PartitionInterval: part}); err != nil {
				t.Fatalf("migrate %s: %v", tbl.Qualified(), err)
			}
			want := enqueue.Layout{Partitioned: part > 0, PayloadType: ptype}
			if l, err := enqueue.LayoutOf(ctx, pool, tbl); err != nil || l != want {
				t.Errorf("%s: %+v, %v; want %+v", tbl.Qualified(), l, err, want)
			}
		}
	}
	if _, err := schema.MigrateWith(ctx, conn, missing, schema.MigrateOptions{PayloadType: "bytea"}); err != nil {
		t.Fatal(err)
	}
	if l, err := enqueue.LayoutOf(ctx, pool, missing); err != nil || l != (enqueue.Layout{PayloadType: "bytea"}) {
		t.Errorf("the missing table, made: %+v, %v; want bytea", l, err)
	}
}

// TestEnqueueBytesNeverThroughText: a bytea payload goes to the database
// as bytes. Bytes that spell bytea's hex text (\x41) stay those four
// bytes, not "A"; an empty payload is zero bytes, not NULL; the comparison
// is byte for byte. The statements are EnqueueOne, EnqueueRows and
// CompareEnqueued, plain and partitioned.
func TestEnqueueBytesNeverThroughText(t *testing.T) {
	t.Parallel()
	for _, part := range []time.Duration{0, time.Hour} {
		t.Run(fmt.Sprint("partitioned=", part > 0), func(t *testing.T) {
			t.Parallel()
			url := testenv.Shared(t).PG.CreateDatabase(t)
			tbl := store.Table{Schema: "public", Name: "outbox"}
			if _, err := schema.MigrateWith(context.Background(), connect(t, url), tbl, schema.MigrateOptions{PayloadType: "bytea", PartitionInterval: part}); err != nil {
				t.Fatal(err)
			}
			pool := newPool(t, url)
			ctx := context.Background()
			stored := func(id string) []byte {
				t.Helper()
				var b []byte
				if err := pool.QueryRow(ctx, `SELECT payload FROM outbox WHERE work_id = $1`, id).Scan(&b); err != nil {
					t.Fatalf("%s: %v", id, err)
				}
				return b
			}
			hexText := `\x41`
			if ok, err := enqueue.One(ctx, pool, tbl, enqueue.Row{WorkID: "one", Kind: "k", Payload: hexText}); err != nil || !ok {
				t.Fatalf("EnqueueOne: %v, %v", ok, err)
			}
			if b := stored("one"); string(b) != hexText {
				t.Errorf("EnqueueOne stored %q, want %q", b, hexText)
			}
			ordered := enqueue.Row{WorkID: "ordered", Kind: "k", Payload: "\x00\xff", AggregateType: "a", AggregateID: "1"}
			if ok, err := enqueue.One(ctx, pool, tbl, ordered); err != nil || !ok {
				t.Fatalf("EnqueueOne ordered: %v, %v", ok, err)
			}
			if b := stored("ordered"); string(b) != "\x00\xff" {
				t.Errorf("EnqueueOne ordered stored %q", b)
			}
			rows := []enqueue.Row{{WorkID: "two", Kind: "k", Payload: hexText}, {WorkID: "empty", Kind: "k"}, {WorkID: "one", Kind: "k", Payload: "A"}}
			ins, err := enqueue.Rows(ctx, pool, tbl, rows)
			if err != nil || len(ins) != 2 || !ins["two"] || !ins["empty"] {
				t.Fatalf("EnqueueRows: %v, %v", ins, err)
			}
			if b := stored("two"); string(b) != hexText {
				t.Errorf("EnqueueRows stored %q, want %q", b, hexText)
			}
			if b := stored("empty"); b == nil || len(b) != 0 {
				t.Errorf("EnqueueRows stored %q (nil: %v) for an empty payload, want zero bytes", b, b == nil)
			}
			cmp, err := enqueue.Compare(ctx, pool, tbl, []enqueue.Row{
				{WorkID: "one", Kind: "k", Payload: "A"}, {WorkID: "one", Kind: "k", Payload: hexText}, {WorkID: "empty", Kind: "k"}, {WorkID: "gone", Kind: "k"}})
			if err != nil || len(cmp) != 4 {
				t.Fatalf("CompareEnqueued: %v, %v", cmp, err)
			}
			if c := cmp[0]; !c.Found || c.SamePayload || c.Payload != `\x5c783431` {
				t.Errorf("\"A\" against %q: %+v", hexText, c)
			}
			if c := cmp[1]; !c.Found || !c.SamePayload || !c.SameKind || !c.SameSubject {
				t.Errorf("the same bytes: %+v", c)
			}
			if c := cmp[2]; !c.Found || !c.SamePayload {
				t.Errorf("empty against empty: %+v", c)
			}
			if cmp[3].Found {
				t.Errorf("a work_id not stored: %+v", cmp[3])
			}
		})
	}
}

// TestEnqueueLayoutForgotten: the layout is kept, and a table dropped and
// made again under the same name with another payload type costs one
// failed statement; a payload column made by hand of another type (text)
// is written as jsonb was before --payload-type.
func TestEnqueueLayoutForgotten(t *testing.T) {
	t.Parallel()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	pool := newPool(t, url)
	ctx := context.Background()
	create := func(name, ptype string) store.Table {
		t.Helper()
		if _, err := pool.Exec(ctx, `DROP TABLE IF EXISTS `+name+`; CREATE TABLE `+name+` (work_id text PRIMARY KEY, kind text NOT NULL,
			subject text, payload `+ptype+` NOT NULL, headers jsonb, available_at timestamptz NOT NULL, expires_at timestamptz)`); err != nil {
			t.Fatal(err)
		}
		return store.Table{Schema: "public", Name: name}
	}
	text := `{"z": 1,   "a": 2}`
	stored := func(tbl store.Table, id string) string {
		t.Helper()
		var s string
		if err := pool.QueryRow(ctx, `SELECT payload::text FROM `+tbl.String()+` WHERE work_id = $1`, id).Scan(&s); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		return s
	}

	tbl := create("by_hand", "bytea")
	if ok, err := enqueue.One(ctx, pool, tbl, enqueue.Row{WorkID: "b", Kind: "k", Payload: "\x01\x02"}); err != nil || !ok {
		t.Fatalf("bytea: %v, %v", ok, err)
	}
	if s := stored(tbl, "b"); s != `\x0102` {
		t.Errorf("bytea stored %s", s)
	}
	create("by_hand", "json")
	if _, err := enqueue.One(ctx, pool, tbl, enqueue.Row{WorkID: "j", Kind: "k", Payload: text}); err == nil {
		t.Fatalf("the first insert after the table changed type went through with the kept layout")
	}
	if ok, err := enqueue.One(ctx, pool, tbl, enqueue.Row{WorkID: "j", Kind: "k", Payload: text}); err != nil || !ok {
		t.Fatalf("json, again: %v, %v", ok, err)
	}
	if s := stored(tbl, "j"); s != text {
		t.Errorf("json stored %q, want %q", s, text)
	}
	if l, err := enqueue.LayoutOf(ctx, pool, tbl); err != nil || l.PayloadType != "json" {
		t.Errorf("layout after the change: %+v, %v", l, err)
	}

	byHand := create("by_hand_text", "text")
	if l, err := enqueue.LayoutOf(ctx, pool, byHand); err != nil || l.PayloadType != "jsonb" {
		t.Errorf("text column: %+v, %v; want it written as jsonb", l, err)
	}
	if ins, err := enqueue.Rows(ctx, pool, byHand, []enqueue.Row{{WorkID: "t", Kind: "k", Payload: text}}); err != nil || !ins["t"] {
		t.Fatalf("text column: %v, %v", ins, err)
	}
	if s := stored(byHand, "t"); s != `{"a": 2, "z": 1}` {
		t.Errorf("text column stored %q, want jsonb's text", s)
	}
}

func TestMain(m *testing.M) { testenv.Main(m) }

func connect(t *testing.T, url string) *pgx.Conn { return testenv.Connect(t, url) }
