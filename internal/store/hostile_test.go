package store_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/internal/wire/wiretest"
)

// The table's CHECKs (migration 0005) and the relay's rules (internal/wire)
// agree on every work ID and kind: a value the relay would refuse as a
// header is refused at insert, where the producer still sees the error, and
// a value the table takes is one the relay can publish exactly. Subjects in
// the server's namespaces are refused by both.
func TestTableChecksMatchTheRelay(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := store.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 1))
	insert := func(workID, kind string, subject *string) error {
		_, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, subject, payload) VALUES ($1, $2, $3, '{}')`, workID, kind, subject)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23514" { // check_violation
			return err
		}
		if err != nil {
			t.Fatalf("insert %q/%q: %v", workID, kind, err)
		}
		return nil
	}
	refusedBoth, acceptedBoth := 0, 0
	for i := range 3000 {
		id := wiretest.String(r, 1100)
		// Make IDs distinct without changing their verdict.
		if wire.ValidateWorkID(id) == nil && len(id) < 1000 {
			id = "k" + string(rune('a'+i%26)) + id + string(rune('a'+i/26%26)) + string(rune('a'+i/676))
		}
		relayErr := wire.ValidateWorkID(id)
		tableErr := insert(id, "k", nil)
		if (relayErr == nil) != (tableErr == nil) {
			t.Errorf("work_id %q: relay says %v, table says %v", id, relayErr, tableErr)
		}
		kind := wiretest.String(r, 300)
		relayErr = wire.ValidateKind(kind)
		tableErr = insert("kind-"+string(rune('a'+i%26))+string(rune('a'+i/26%26))+string(rune('a'+i/676)), kind, nil)
		if (relayErr == nil) != (tableErr == nil) {
			t.Errorf("kind %q: relay says %v, table says %v", kind, relayErr, tableErr)
		}
		if relayErr == nil {
			acceptedBoth++
		} else {
			refusedBoth++
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
