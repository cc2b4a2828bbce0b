package relay_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Issue 30, item 11. A SQL_ASCII database stores any bytes in text and
// jsonb: a payload or a header value that is not UTF-8 was published (the
// payload as it was, the header value with U+FFFD in place of its bytes).
// Now such a row is refused on both paths, like a work ID that a header
// cannot carry: inserted 'ready' (CDC) and 'scheduled' (poller), each ends
// failed with its reason and never reaches the stream, while the valid rows
// beside it flow; and the start says the database is SQL_ASCII. In a LATIN1
// database a row's é used to be published as the byte 0xE9, which is not
// UTF-8 either: the relay now asks PostgreSQL for UTF-8 on every
// connection, so the message carries é in UTF-8 (and in SQL_ASCII, where
// asking for UTF-8 would stop every row behind a bad one, for SQL_ASCII).
func TestRowsThatAreNotUTF8AreRefused(t *testing.T) {
	env := testenv.Shared(t)
	newEncoded := func(t *testing.T, encoding string) (*harness, *testenv.LogBuffer) {
		stream, prefix := env.StreamName(t)
		h := newHarness(t, setup{dbURL: env.PG.CreateDatabaseEncoded(t, encoding), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
		h.opts.MaxAttempts = 2
		h.opts.RejectRetry = 50 * time.Millisecond
		logs := &testenv.LogBuffer{}
		h.logs = logs
		return h, logs
	}
	// bytes is a jsonb value holding exactly these bytes, whatever the
	// connection's client_encoding.
	bytes := func(s string) string {
		return "convert_from('\\x" + hex.EncodeToString([]byte(s)) + "'::bytea, 'SQL_ASCII')::jsonb"
	}
	ctx := context.Background()

	t.Run("SQL_ASCII", func(t *testing.T) {
		h, logs := newEncoded(t, "SQL_ASCII")
		// A client_encoding of UTF8 (here the database's setting) made
		// PostgreSQL fail the stream and every claim on the first byte that
		// is not UTF-8: the relay keeps its connections in SQL_ASCII there.
		h.exec(`DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET client_encoding = %L', current_database(), 'UTF8'); END $$`)
		h.start()
		type bad struct{ id, payload, headers, reason string }
		var rows []bad
		for _, state := range []string{"ready", "scheduled"} {
			rows = append(rows,
				bad{"payload-" + state, bytes("{\"a\":\"x\xffy\"}"), "NULL", "invalid_payload"},
				bad{"header-" + state, "'{}'", bytes("{\"traceparent\":\"00-\xfe-01\"}"), "invalid_header"})
			for _, b := range rows[len(rows)-2:] {
				h.exec(`INSERT INTO outbox (work_id, kind, payload, headers, state) VALUES ($1, 'thing_happened', `+b.payload+`, `+b.headers+`, $2)`, b.id, state)
			}
		}
		good := h.insertRows("good", 4, 2)
		h.exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('good-scheduled', 'thing_happened', '{"n":1}', 'scheduled')`)
		good = append(good, "good-scheduled")

		testenv.WaitFor(t, 60*time.Second, "the rows that are not UTF-8 failed, the others published", func() (bool, error) {
			f, p := h.countState("failed"), h.countState("published")
			return f == len(rows) && p == len(good), fmt.Errorf("failed %d of %d, published %d (want %d), stream holds %d", f, len(rows), p, len(good), h.streamCount())
		})
		for _, b := range rows {
			var state, lastErr string
			if err := h.pool.QueryRow(ctx, `SELECT state, last_error FROM outbox WHERE work_id = $1`, b.id).Scan(&state, &lastErr); err != nil {
				t.Fatal(err)
			}
			if state != "failed" || !strings.HasPrefix(lastErr, "rejected: "+b.reason+": ") || !strings.Contains(lastErr, "not valid UTF-8") {
				t.Errorf("%s: %s, %q; want failed with rejected: %s ... not valid UTF-8", b.id, state, lastErr, b.reason)
			}
		}
		h.assertExactlyOnce(good)
		if l := logs.String(); !strings.Contains(l, "SQL_ASCII") || !strings.Contains(l, "ENCODING 'UTF8'") {
			t.Errorf("no warning at start that the database is SQL_ASCII, with the fix; logs:\n%s", l)
		}
	})

	t.Run("LATIN1", func(t *testing.T) {
		h, _ := newEncoded(t, "LATIN1")
		h.start()
		// chr(233) is é in the database's own encoding.
		for _, state := range []string{"ready", "scheduled"} {
			h.exec(`INSERT INTO outbox (work_id, kind, payload, headers, state) VALUES ($1, 'thing_happened',
				jsonb_build_object('name', 'Ren' || chr(233)), jsonb_build_object('x-name', 'Ren' || chr(233)), $2)`, "latin1-"+state, state)
		}
		h.waitPublished(2, 30*time.Second)
		byID, _ := h.streamMsgs()
		for _, id := range []string{"latin1-ready", "latin1-scheduled"} {
			m := byID[id]
			if m == nil {
				t.Fatalf("%s is not in the stream", id)
			}
			if got, want := string(m.Data), `{"name": "René"}`; got != want || !utf8.Valid(m.Data) {
				t.Errorf("%s: data %q, want %q in UTF-8", id, got, want)
			}
			if got := m.Header.Get("x-name"); got != "René" {
				t.Errorf("%s: header x-name %q, want %q", id, got, "René")
			}
		}
	})
}
