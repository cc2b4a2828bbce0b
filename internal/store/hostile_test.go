package store_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/internal/wire/wiretest"
)

// The table's CHECKs (migrations 0005, 0006) and the relay's rules
// (internal/wire) agree on every work ID, kind and aggregate: a value the
// relay would refuse as a header is refused at insert, where the producer
// still sees the error, and a value the table takes is one the relay can
// publish exactly. They are compared exactly at each byte limit (limit-1,
// limit, limit+1, with multi-byte characters ending at and straddling it,
// and the empty string), where a drift of either side shows, and on random
// hostile values. Subjects in the server's namespaces are refused by both.
func TestTableChecksMatchTheRelay(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 1))
	type row struct {
		workID, kind   string
		subject        *string
		aggType, aggID string
		aggSeq         int64
	}
	insertRow := func(w row) error {
		var typ, id, seq any
		if w.aggSeq != 0 {
			typ, id, seq = w.aggType, w.aggID, w.aggSeq
		}
		_, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, subject, payload, aggregate_type, aggregate_id, aggregate_seq) VALUES ($1, $2, $3, '{}', $4, $5, $6)`,
			w.workID, w.kind, w.subject, typ, id, seq)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23514" { // check_violation
			return err
		}
		if err != nil {
			t.Fatalf("insert %.40q/%.40q: %v", w.workID, w.kind, err)
		}
		return nil
	}
	insert := func(workID, kind string, subject *string) error {
		return insertRow(row{workID: workID, kind: kind, subject: subject})
	}
	n := 0
	uniq := func(prefix string) string { n++; return fmt.Sprintf("%s-%d", prefix, n) }
	fields := []struct {
		name  string
		limit int
		relay func(string) error
		table func(string) error
	}{
		{"work_id", wire.MaxWorkIDBytes, wire.ValidateWorkID,
			func(v string) error { return insert(v, "k", nil) }},
		{"kind", wire.MaxKindBytes, wire.ValidateKind,
			func(v string) error { return insert(uniq("kind"), v, nil) }},
		{"aggregate_type", wire.MaxKindBytes, func(v string) error { return wire.ValidateAggregate(v, "a", 1) },
			func(v string) error {
				return insertRow(row{workID: uniq("type"), kind: "k", aggType: v, aggID: uniq("a"), aggSeq: 1})
			}},
		{"aggregate_id", wire.MaxWorkIDBytes, func(v string) error { return wire.ValidateAggregate("t", v, 1) },
			func(v string) error {
				return insertRow(row{workID: uniq("id"), kind: "k", aggType: uniq("t"), aggID: v, aggSeq: 1})
			}},
	}
	for _, f := range fields {
		values := wiretest.AtLimit(f.limit)
		for _, v := range values {
			relayErr, tableErr := f.relay(v), f.table(v)
			if (relayErr == nil) != (tableErr == nil) {
				t.Errorf("%s of %d bytes (%d characters, limit %d) %.12q...: relay says %v, table says %v",
					f.name, len(v), utf8.RuneCountInString(v), f.limit, v, relayErr, tableErr)
			}
			// Both sides count bytes, from 1 to the limit: a rule that
			// counts characters, or is off by one, fails here too.
			if want := v != "" && len(v) <= f.limit; (relayErr == nil) != want {
				t.Errorf("%s of %d bytes (%d characters, limit %d): relay says %v, want accepted=%v",
					f.name, len(v), utf8.RuneCountInString(v), f.limit, relayErr, want)
			}
		}
		t.Logf("%s: %d values at its %d-byte limit", f.name, len(values), f.limit)
	}

	refusedBoth, acceptedBoth := 0, 0
	seen := map[string]bool{}
	for i := range 3000 {
		id := wiretest.String(r, 1100)
		if r.IntN(3) == 0 {
			id = wiretest.Near(r, wire.MaxWorkIDBytes)
		}
		// Make IDs distinct without changing their verdict.
		if wire.ValidateWorkID(id) == nil && len(id) < 1000 {
			id = "k" + string(rune('a'+i%26)) + id + string(rune('a'+i/26%26)) + string(rune('a'+i/676))
		}
		if !seen[id] {
			seen[id] = true
			relayErr := wire.ValidateWorkID(id)
			tableErr := insert(id, "k", nil)
			if (relayErr == nil) != (tableErr == nil) {
				t.Errorf("work_id %q: relay says %v, table says %v", id, relayErr, tableErr)
			}
		}
		kind := wiretest.String(r, 300)
		if r.IntN(3) == 0 {
			kind = wiretest.Near(r, wire.MaxKindBytes)
		}
		relayErr := wire.ValidateKind(kind)
		tableErr := insert(uniq("kind"), kind, nil)
		if (relayErr == nil) != (tableErr == nil) {
			t.Errorf("kind %q: relay says %v, table says %v", kind, relayErr, tableErr)
		}
		if relayErr == nil {
			acceptedBoth++
		} else {
			refusedBoth++
		}
		typ, aggID := "t", uniq("a")
		if r.IntN(2) == 0 {
			typ = wiretest.Near(r, wire.MaxKindBytes)
		} else {
			aggID = wiretest.Near(r, wire.MaxWorkIDBytes)
		}
		relayErr = wire.ValidateAggregate(typ, aggID, int64(i+1))
		tableErr = insertRow(row{workID: uniq("agg"), kind: "k", aggType: typ, aggID: aggID, aggSeq: int64(i + 1)})
		if (relayErr == nil) != (tableErr == nil) {
			t.Errorf("aggregate %.40q/%.40q: relay says %v, table says %v", typ, aggID, relayErr, tableErr)
		}
	}
	// Issue 16's reproductions: four rows that collapsed into one message,
	// and a blank ID that was published without one.
	for _, id := range []string{"col-x ", "col-x\n", "\tcol-x", " ", "x\x1b[2K\r\nredrove 0 rows; all good"} {
		if err := insert(id, "k", nil); err == nil {
			t.Errorf("work_id %q: the table took it", id)
		}
	}
	if err := insert("col-x", "k\r\nNats-Rollup: all", nil); err == nil {
		t.Error("a kind with CRLF: the table took it")
	}
	for _, s := range []string{"$JS.API.STREAM.DELETE.OUTBOX", "$JS.API.STREAM.PURGE.VICTIM", "$SYS.REQ.SERVER.PING", "$KV.b.k", "_INBOX.x", "_INBOX"} {
		if err := insert("subj-"+s, "k", &s); err == nil {
			t.Errorf("subject %q: the table took it", s)
		}
		if err := wire.ValidateSubject(s); !errors.Is(err, wire.ErrReservedSubject) {
			t.Errorf("subject %q: relay says %v, want ErrReservedSubject", s, err)
		}
	}
	for _, s := range []string{"orders.1", "_INBOXES.x", "x.$JS", "x._INBOX"} {
		if err := insert("subj-"+s, "k", &s); err != nil {
			t.Errorf("subject %q: the table refused it: %v", s, err)
		}
	}
	t.Logf("kinds: %d accepted, %d refused by both", acceptedBoth, refusedBoth)
	if acceptedBoth < 100 || refusedBoth < 100 {
		t.Errorf("the generator gave %d accepted and %d refused kinds: too few of one side to compare", acceptedBoth, refusedBoth)
	}
}
