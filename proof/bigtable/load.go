package bigtable

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"golang.org/x/sync/errgroup"
)

// ServerConf is what the PostgreSQL server of a run needs beyond the test
// defaults: pg_stat_statements for each statement's calls and times, and
// auto_explain for its plans (off until the window opens: its
// log_min_duration is left out here, since a setting on the server's
// command line would override the ALTER SYSTEM that turns it on). The log
// goes through the logging collector into logDir (see LogDir): without it
// every backend writes to one pipe, and a plan longer than the pipe's
// atomic write (4 kB) comes out cut into other backends' lines. WAL sized
// for the preload, so it does not checkpoint every few seconds.
func ServerConf(logDir string) map[string]string {
	return map[string]string{
		"shared_preload_libraries":           "pg_stat_statements,auto_explain",
		"compute_query_id":                   "on",
		"pg_stat_statements.max":             "5000",
		"auto_explain.log_format":            "json",
		"auto_explain.log_verbose":           "on",
		"auto_explain.log_nested_statements": "on",
		"logging_collector":                  "on",
		"log_directory":                      logDir,
		"log_filename":                       "postgresql.log",
		"log_rotation_age":                   "0",
		"log_rotation_size":                  "0",
		"max_wal_size":                       "8GB",
		"checkpoint_timeout":                 "15min",
	}
}

// LogDir makes a directory the server (running as the postgres user) can
// write its log into; the log is LogPath(dir).
func LogDir() (string, error) {
	dir, err := os.MkdirTemp("", "outbox-bigtable-pglog-")
	if err != nil {
		return "", err
	}
	return dir, os.Chmod(dir, 0o777)
}

// LogPath is the server's log in a directory from LogDir.
func LogPath(dir string) string { return filepath.Join(dir, "postgresql.log") }

// loadChunk rows per INSERT of the preload: progress every chunk, and no
// transaction larger than this. loadWorkers chunks are inserted at once.
const (
	loadChunk   = 500_000
	loadWorkers = 2
)

type preloaded struct {
	deadLetter string
	held       int
}

// preload fills the migrated table with c.Rows published rows, every fifth
// one in an aggregate (c.Aggregates of them, each row the next sequence of
// its aggregate, interleaved in time as real ones are), a dead letter in
// aggregate "7" three rows before its end and its last three rows ready
// behind it, then VACUUM ANALYZE: a table as a long-running deployment
// leaves it, visibility map and statistics included.
//
// Rows are one every 50 ms back from an hour ago; each published 20 ms
// after it was created, with a stream sequence of its own. The table's
// indexes are dropped for the load and built again after it, as
// migrate defined them: one sorted build is many times faster than a
// million insertions into each.
func preload(ctx context.Context, conn *pgx.Conn, c Config) (preloaded, error) {
	var p preloaded
	rebuild, err := dropIndexes(ctx, conn)
	if err != nil {
		return p, err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(loadWorkers)
	for lo := 0; lo < c.Rows; lo += loadChunk {
		hi := min(lo+loadChunk, c.Rows) - 1
		g.Go(func() error {
			conn, err := pgx.Connect(gctx, c.DBURL)
			if err != nil {
				return fmt.Errorf("preload: connect: %w", err)
			}
			defer conn.Close(context.Background())
			t := time.Now()
			_, err = conn.Exec(gctx, `INSERT INTO outbox (work_id, kind, payload, state, created_at, available_at, attempts,
				published_at, stream_seq, stream_name, aggregate_type, aggregate_id, aggregate_seq)
			SELECT 'pre-' || i, CASE WHEN i % 5 = 0 THEN 'account_event' ELSE 'order_event' END,
				jsonb_build_object('n', i, 'customer', 'c-' || (i % 9973), 'note', md5(i::text) || md5((i + 1)::text)),
				'published', t, t, 1, t + interval '20 ms', i + 1, $5,
				CASE WHEN i % 5 = 0 THEN 'account' END,
				CASE WHEN i % 5 = 0 THEN ((i / 5) % $3)::text END,
				CASE WHEN i % 5 = 0 THEN (i / 5) / $3 + 1 END
			FROM generate_series($1::bigint, $2::bigint) AS i,
				LATERAL (SELECT now() - interval '1 hour' - ($4::bigint - i) * interval '50 ms') AS x(t)`,
				lo, hi, c.Aggregates, c.Rows, c.Stream)
			if err != nil {
				return fmt.Errorf("preload rows %d-%d: %w", lo, hi, err)
			}
			c.Logf("preload: rows %d-%d in %.1fs", lo, hi, time.Since(t).Seconds())
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return p, err
	}
	t := time.Now()
	for _, ddl := range rebuild {
		if _, err := conn.Exec(ctx, ddl); err != nil {
			return p, fmt.Errorf("preload: rebuild index: %s: %w", ddl, err)
		}
	}
	c.Logf("preload: indexes built again in %.1fs", time.Since(t).Seconds())
	// The sequence counters the producers' outbox_next_seq continues from.
	if _, err := conn.Exec(ctx, `INSERT INTO outbox_aggregates (aggregate_type, aggregate_id, last_seq)
		SELECT 'account', a::text, ((`+strconv.Itoa(c.Rows)+` - 1) / 5 - a) / $1 + 1
		FROM generate_series(0, least($1, (`+strconv.Itoa(c.Rows)+` - 1) / 5 + 1) - 1) AS a`, c.Aggregates); err != nil {
		return p, fmt.Errorf("preload aggregate counters: %w", err)
	}
	if c.Control {
		return p, vacuum(ctx, conn, c)
	}
	// The dead letter: rejected by the broker after its attempts, as the
	// poller leaves one; the rows after it wait, never published.
	var last int64
	if err := conn.QueryRow(ctx, `SELECT last_seq FROM outbox_aggregates WHERE aggregate_type = 'account' AND aggregate_id = '7'`).Scan(&last); err != nil {
		return p, fmt.Errorf("preload: aggregate 7: %w", err)
	}
	if last < 5 {
		return p, fmt.Errorf("preload: aggregate 7 has %d rows, too few for a dead letter with rows behind it (more -rows or fewer aggregates)", last)
	}
	err = conn.QueryRow(ctx, `UPDATE outbox SET state = 'failed', published_at = NULL, stream_seq = NULL, stream_name = NULL, attempts = 5,
			available_at = now() - interval '10 minutes',
			last_error = 'rejected: max_payload: message size exceeds the stream''s limit (preloaded dead letter)'
		WHERE aggregate_type = 'account' AND aggregate_id = '7' AND aggregate_seq = $1 RETURNING work_id`, last-3).Scan(&p.deadLetter)
	if err != nil {
		return p, fmt.Errorf("preload: dead letter: %w", err)
	}
	tag, err := conn.Exec(ctx, `UPDATE outbox SET state = 'ready', published_at = NULL, stream_seq = NULL, stream_name = NULL, attempts = 0
		WHERE aggregate_type = 'account' AND aggregate_id = '7' AND aggregate_seq > $1`, last-3)
	if err != nil {
		return p, fmt.Errorf("preload: rows behind the dead letter: %w", err)
	}
	p.held = int(tag.RowsAffected())
	return p, vacuum(ctx, conn, c)
}

func vacuum(ctx context.Context, conn *pgx.Conn, c Config) error {
	t := time.Now()
	for _, tbl := range []string{"outbox", "outbox_aggregates"} {
		if _, err := conn.Exec(ctx, `VACUUM ANALYZE `+tbl); err != nil {
			return fmt.Errorf("preload: vacuum analyze %s: %w", tbl, err)
		}
	}
	c.Logf("preload: VACUUM ANALYZE in %.1fs", time.Since(t).Seconds())
	return nil
}

// dropIndexes drops the outbox table's indexes (the primary key's
// constraint with its index) and returns the DDL that makes them again.
func dropIndexes(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	rows, err := conn.Query(ctx, `SELECT c.relname, con.conname,
			coalesce('ALTER TABLE outbox ADD CONSTRAINT ' || quote_ident(con.conname) || ' ' || pg_get_constraintdef(con.oid),
				pg_get_indexdef(i.indexrelid))
		FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
		WHERE i.indrelid = 'outbox'::regclass`)
	if err != nil {
		return nil, fmt.Errorf("preload: list indexes: %w", err)
	}
	type index struct{ name, constraint, ddl string }
	var idx []index
	var x index
	var con *string
	if _, err := pgx.ForEachRow(rows, []any{&x.name, &con, &x.ddl}, func() error {
		x.constraint = ""
		if con != nil {
			x.constraint = *con
		}
		idx = append(idx, x)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("preload: list indexes: %w", err)
	}
	var rebuild []string
	for _, x := range idx {
		drop := `DROP INDEX ` + pgx.Identifier{x.name}.Sanitize()
		if x.constraint != "" {
			drop = `ALTER TABLE outbox DROP CONSTRAINT ` + pgx.Identifier{x.constraint}.Sanitize()
		}
		if _, err := conn.Exec(ctx, drop); err != nil {
			return nil, fmt.Errorf("preload: %s: %w", drop, err)
		}
		rebuild = append(rebuild, x.ddl)
	}
	if _, err := conn.Exec(ctx, `SET maintenance_work_mem = '512MB'`); err != nil {
		return nil, err
	}
	return rebuild, nil
}

// trickle commits rate rows a second, one row per autocommitted INSERT, on
// a fixed schedule (a late insert does not push the next ones back). Of
// every ten rows, two continue existing aggregates (0 to 499, never
// aggregate 7, which the dead letter holds: its rows would wait behind it),
// two start aggregates of their own, five are unordered, and one is
// delayed by a second (available_at) in an aggregate of 500 to 999: the CDC
// path hands it to the poller, whose ordered claim then checks the rows
// below it in its aggregate, the preloaded history included.
type trickle struct {
	url        string
	rate       float64
	aggregates int
	noDelayed  bool // the delayed row of every ten is unordered instead

	mu      sync.Mutex
	commits map[string]time.Time // work_id -> when its INSERT returned
	kinds   map[string]string    // work_id -> one of the row kinds below
}

// The trickle's kinds of row.
const (
	rowUnordered = "unordered"
	rowNewAgg    = "own aggregate"
	rowOldAgg    = "preloaded aggregate"
	rowDelayed   = "delayed (poller)"
)

// trickleDelay is how long after its commit a delayed row is due.
const trickleDelay = time.Second

func (t *trickle) run(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, t.url)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())
	t.commits, t.kinds = map[string]time.Time{}, map[string]string{}
	interval := time.Duration(float64(time.Second) / t.rate)
	half := max(t.aggregates/2, 1)
	start := time.Now()
	for k := 0; ; k++ {
		if d := time.Until(start.Add(time.Duration(k) * interval)); d > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(d):
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		id := "live-" + strconv.Itoa(k)
		var aggType, aggID *string
		var delay int64
		kind := rowUnordered
		account := func(a int) {
			if a == 7 {
				a = 8
			}
			typ, s := "account", strconv.Itoa(a%t.aggregates)
			aggType, aggID = &typ, &s
		}
		switch k % 10 {
		case 0, 5:
			account((k / 5) % half)
			kind = rowOldAgg
		case 1, 6:
			typ, s := "trickle", id
			aggType, aggID = &typ, &s
			kind = rowNewAgg
		case 3:
			if t.noDelayed {
				break
			}
			account(half + (k/10)%half)
			delay = trickleDelay.Microseconds()
			kind = rowDelayed
		}
		_, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq, available_at)
			VALUES ($1, 'order_event', jsonb_build_object('n', $2::int, 'note', md5($1)), $3::text, $4::text, outbox_next_seq($3::text, $4::text),
				clock_timestamp() + $5::bigint * interval '1 microsecond')`,
			id, k, aggType, aggID, delay)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("insert %s: %w", id, err)
		}
		now := time.Now()
		t.mu.Lock()
		t.commits[id] = now
		t.kinds[id] = kind
		t.mu.Unlock()
	}
}
