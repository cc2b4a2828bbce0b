package replication

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
)

// Querier is what the catalog checks need from a regular (non-replication)
// connection: a pgx.Conn, pgx.Tx or pgxpool.Pool.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

var namePattern = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)

// ValidateName checks a slot or publication name. PostgreSQL only allows
// lower-case letters, digits and underscores in slot names; publications are
// held to the same rule so the name can go into pgoutput's options unquoted.
func ValidateName(flag, name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("--%s %q: use 1 to 63 lower-case letters, digits and underscores", flag, name)
	}
	return nil
}

// Connect opens a replication connection (replication=database) from a libpq
// URL or key=value string. It pins DateStyle and TimeZone, because pgoutput
// renders timestamps as text with the walsender's settings and the decoder
// parses them, and it uses deadlines (not cancel requests) for context
// expiry, so a receive timeout leaves the stream intact.
func Connect(ctx context.Context, connString, appName string) (*pgconn.PgConn, error) {
	return ConnectWith(ctx, connString, appName, nil)
}

// PasswordFunc gives the password of one new connection to host:port as
// user: a rotated secret read again, or a token signed for that endpoint.
type PasswordFunc func(ctx context.Context, host string, port uint16, user string) (string, error)

// ConnectWith is Connect with the password asked for as the connection
// opens (nil: the connection string's, or libpq's PGPASSWORD and .pgpass):
// a password that rotates while the relay runs is read again at every
// reconnect.
func ConnectWith(ctx context.Context, connString, appName string, password PasswordFunc) (*pgconn.PgConn, error) {
	cfg, err := pgconn.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse --database-url: %w", err)
	}
	if password != nil {
		if cfg.Password, err = password(ctx, cfg.Host, cfg.Port, cfg.User); err != nil {
			return nil, fmt.Errorf("open replication connection: %w", err)
		}
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["DateStyle"] = "ISO, MDY"
	cfg.RuntimeParams["TimeZone"] = "UTC"
	cfg.RuntimeParams["IntervalStyle"] = "postgres"
	// A bytea payload arrives as its text; the hex form is the one the
	// decoder reads, whatever the server's or the role's default.
	cfg.RuntimeParams["bytea_output"] = "hex"
	if appName != "" {
		cfg.RuntimeParams["application_name"] = appName
	}
	cfg.AfterNetConnect = wrapDrainable
	cfg.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: c.Conn()}
	}
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open replication connection to %s:%d: %w", cfg.Host, cfg.Port, explainConnectError(err))
	}
	if err := PinClientEncoding(ctx, conn); err != nil {
		_ = conn.Close(ctx)
		return nil, err
	}
	return conn, nil
}

// PinClientEncoding makes PostgreSQL send text in UTF-8, what messages
// carry (JSON and NATS headers are UTF-8): pgoutput and query results come
// in the connection's client_encoding, which follows the database's
// encoding unless a setting says otherwise, so a LATIN1 database's é
// arrived as the byte 0xE9 and was published so. A SQL_ASCII database is
// the exception: PostgreSQL converts nothing from it and, asked for UTF-8,
// fails the whole statement (or the replication stream) on the first byte
// that is not UTF-8, stopping every row behind it; there the connection
// stays in SQL_ASCII, takes the bytes as they are, and the relay refuses a
// row that is not UTF-8 (wire.ValidatePayload). One statement, only when
// the encoding is not already the one wanted.
func PinClientEncoding(ctx context.Context, conn *pgconn.PgConn) error {
	want := "UTF8"
	if conn.ParameterStatus("server_encoding") == "SQL_ASCII" {
		want = "SQL_ASCII"
	}
	if conn.ParameterStatus("client_encoding") == want {
		return nil
	}
	if _, err := conn.Exec(ctx, "SET client_encoding = '"+want+"'").ReadAll(); err != nil {
		return fmt.Errorf("set client_encoding to %s (the database's encoding is %s): %w", want, conn.ParameterStatus("server_encoding"), err)
	}
	return nil
}

func explainConnectError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InvalidAuthorizationSpecification {
		return fmt.Errorf("%w (the role needs the REPLICATION attribute and pg_hba.conf must allow it: ALTER ROLE ... WITH REPLICATION)", err)
	}
	return err
}

// CheckServer verifies what logical decoding needs from the server and the
// role, with messages that say how to fix each problem.
func CheckServer(ctx context.Context, q Querier) error {
	var standby bool
	if err := q.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&standby); err != nil {
		return fmt.Errorf("read pg_is_in_recovery(): %w", err)
	}
	if standby {
		// PostgreSQL 16+ can decode on a standby, but the relay marks rows
		// and records its slot: it needs the primary.
		return fmt.Errorf("%w: the server is a standby (in recovery); the relay writes (marks, claims, its slot record) and needs the primary: point --database-url at it, or list every host with target_session_attrs=read-write (postgres://relay@db1,db2/app?target_session_attrs=read-write) so the relay follows a promotion",
			ErrStandby)
	}
	var walLevel string
	if err := q.QueryRow(ctx, `SELECT current_setting('wal_level')`).Scan(&walLevel); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if walLevel != "logical" {
		return fmt.Errorf("wal_level is %q but logical decoding needs 'logical': run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL (a reload is not enough)", walLevel)
	}
	var role string
	var canReplicate bool
	if err := q.QueryRow(ctx,
		`SELECT rolname, rolreplication OR rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user`).Scan(&role, &canReplicate); err != nil {
		return fmt.Errorf("read role attributes: %w", err)
	}
	if !canReplicate {
		return fmt.Errorf("role %q lacks the REPLICATION attribute the slot needs: ALTER ROLE %s WITH REPLICATION (see sql/roles.sql)",
			role, pgx.Identifier{role}.Sanitize())
	}
	var maxSlots int
	if err := q.QueryRow(ctx, `SELECT current_setting('max_replication_slots')::int`).Scan(&maxSlots); err != nil {
		return fmt.Errorf("read max_replication_slots: %w", err)
	}
	if maxSlots < 1 {
		return errors.New("max_replication_slots is 0: set it to at least 1 (ALTER SYSTEM SET max_replication_slots = 10) and restart PostgreSQL")
	}
	return nil
}

// ServerEncoding reads the database's encoding. SQL_ASCII means PostgreSQL
// checks no text it stores and converts none it sends: a row can hold
// bytes that are not UTF-8, and the relay refuses such a row when it
// comes (wire.ValidatePayload). Every other encoding is converted to the
// connection's UTF-8.
func ServerEncoding(ctx context.Context, q Querier) (string, error) {
	var enc string
	if err := q.QueryRow(ctx, `SELECT current_setting('server_encoding')`).Scan(&enc); err != nil {
		return "", fmt.Errorf("read server_encoding: %w", err)
	}
	return enc, nil
}

// ErrStandby says the relay reached a standby where it needs the primary.
var ErrStandby = errors.New("connected to a standby")

// ReadyFilter is the publication's row filter on the outbox table, as
// written at creation; ReadyFilterCatalog is the same as PostgreSQL prints
// it back (pg_get_expr). Only a row inserted 'ready' is the CDC path's: one
// inserted in any other state ('scheduled': for later, or left to the
// poller) belongs to the poller. Unfiltered, the walsender converts every
// such row to text and sends it, and the relay decodes it only to drop it,
// a large share of both processes' CPU on a poller backlog
// (docs/benchmarks.md, "Figures that used to live in code comments").
const (
	ReadyFilter        = `(state = 'ready')`
	ReadyFilterCatalog = `(state = 'ready'::text)`
)

// Publication is what EnsurePublication found.
type Publication struct {
	// Filtered: the publication streams only 'ready' inserts (ReadyFilter).
	// false: an older publication, without a row filter; the relay drops
	// the other rows itself, and FilterPublication adds the filter.
	Filtered bool
}

// EnsurePublication creates the insert-only publication for the table when it
// is missing, and checks an existing one. Insert-only matters: the relay's own
// updates (marks, claims) must never come back through the slot. A row filter
// other than ReadyFilter, or a column list, is refused: a 'ready' row the
// publication leaves out would never be published by anything.
func EnsurePublication(ctx context.Context, q Querier, name, schema, table string) (Publication, error) {
	qualified := pgx.Identifier{schema, table}.Sanitize()
	var exists bool
	if err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1)`, name).Scan(&exists); err != nil {
		return Publication{}, fmt.Errorf("look up publication %s: %w", name, err)
	}
	// A partitioned table is published through its root
	// (publish_via_partition_root): the relay then decodes every row as the
	// table's, whichever partition holds it, and partitions made later are
	// published without a change to the publication.
	var partitioned bool
	if err := q.QueryRow(ctx, `SELECT coalesce((SELECT c.relkind = 'p' FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2), false)`, schema, table).Scan(&partitioned); err != nil {
		return Publication{}, fmt.Errorf("look up table %s: %w", qualified, err)
	}
	with := `publish = 'insert'`
	if partitioned {
		with += `, publish_via_partition_root = true`
	}
	if !exists {
		_, err := q.Exec(ctx, `CREATE PUBLICATION `+pgx.Identifier{name}.Sanitize()+` FOR TABLE `+qualified+` WHERE `+ReadyFilter+` WITH (`+with+`)`)
		var pgErr *pgconn.PgError
		switch {
		case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.DuplicateObject:
			// Created concurrently by another instance; check it below.
		case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege:
			return Publication{}, fmt.Errorf("create publication %s: %w (the table's owner or a superuser must create it: run outbox-relay migrate as the owner)", name, err)
		case err != nil:
			return Publication{}, fmt.Errorf("create publication %s for %s: %w", name, qualified, err)
		}
	}
	var ins, upd, del, trunc, hasTable, columnList, viaRoot bool
	var filter *string
	// The table's own entry (pg_publication_rel) holds its row filter and
	// column list; a publication FOR ALL TABLES or FOR TABLES IN SCHEMA has
	// none, and neither filters.
	err := q.QueryRow(ctx, `SELECT p.pubinsert, p.pubupdate, p.pubdelete, p.pubtruncate, p.pubviaroot,
			EXISTS (SELECT 1 FROM pg_catalog.pg_publication_tables t WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3),
			pg_catalog.pg_get_expr(r.prqual, r.prrelid), coalesce(r.prattrs IS NOT NULL, false)
		FROM pg_catalog.pg_publication p
		LEFT JOIN (pg_catalog.pg_publication_rel r
			JOIN pg_catalog.pg_class c ON c.oid = r.prrelid
			JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace AND n.nspname = $2)
			ON r.prpubid = p.oid AND c.relname = $3
		WHERE p.pubname = $1`, name, schema, table).Scan(&ins, &upd, &del, &trunc, &viaRoot, &hasTable, &filter, &columnList)
	if err != nil {
		return Publication{}, fmt.Errorf("read publication %s: %w", name, err)
	}
	pubName := pgx.Identifier{name}.Sanitize()
	if partitioned && !viaRoot {
		// Without it the slot names each row's partition, not the table,
		// and pg_publication_tables lists the partitions.
		return Publication{}, fmt.Errorf("publication %s publishes the partitions of %s, not the table: ALTER PUBLICATION %s SET (publish_via_partition_root = true)",
			name, qualified, pubName)
	}
	if !hasTable {
		return Publication{}, fmt.Errorf("publication %s does not include %s: ALTER PUBLICATION %s ADD TABLE %s WHERE %s, or choose another --publication",
			name, qualified, pubName, qualified, ReadyFilter)
	}
	var others []string
	rows, err := q.Query(ctx, `SELECT format('%I.%I', schemaname, tablename) FROM pg_catalog.pg_publication_tables
		WHERE pubname = $1 AND (schemaname, tablename) <> ($2, $3) ORDER BY 1 LIMIT 5`, name, schema, table)
	if err != nil {
		return Publication{}, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	if others, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		return Publication{}, fmt.Errorf("read tables of publication %s: %w", name, err)
	}
	if len(others) > 0 {
		// The slot would stream those tables' inserts too: decoded and
		// dropped by this relay, or, when another relay shares the slot,
		// confirmed past before that relay published them.
		return Publication{}, fmt.Errorf("publication %s also publishes %s: the relay needs a publication of %s alone; create one (outbox-relay migrate --publication <new name>) or ALTER PUBLICATION %s DROP TABLE ...",
			name, strings.Join(others, ", "), qualified, pubName)
	}
	if !ins || upd || del || trunc {
		return Publication{}, fmt.Errorf("publication %s must publish inserts only (the relay's own updates would come back through the slot): ALTER PUBLICATION %s SET (publish = 'insert')",
			name, pubName)
	}
	if columnList {
		return Publication{}, fmt.Errorf("publication %s publishes only some columns of %s: the relay reads every column; ALTER PUBLICATION %s SET TABLE %s WHERE %s",
			name, qualified, pubName, qualified, ReadyFilter)
	}
	if filter != nil && *filter != ReadyFilterCatalog {
		return Publication{}, fmt.Errorf("publication %s publishes only the rows of %s WHERE %s: a ready row it leaves out would never be published; ALTER PUBLICATION %s SET TABLE %s WHERE %s",
			name, qualified, *filter, pubName, qualified, ReadyFilter)
	}
	return Publication{Filtered: filter != nil}, nil
}

// FilterPublication gives a publication made before the row filter (see
// ReadyFilter) the filter, after EnsurePublication accepted it. It needs the
// publication's owner (outbox-relay migrate). A walsender streaming the
// publication meanwhile applies the filter from the ALTER's commit on, and
// the relay drops the rows it would have left out, so nothing changes for
// the rows in between.
func FilterPublication(ctx context.Context, q Querier, name, schema, table string) error {
	qualified := pgx.Identifier{schema, table}.Sanitize()
	_, err := q.Exec(ctx, `ALTER PUBLICATION `+pgx.Identifier{name}.Sanitize()+` SET TABLE `+qualified+` WHERE `+ReadyFilter)
	if err != nil {
		return fmt.Errorf("add the row filter WHERE %s to publication %s: %w", ReadyFilter, name, err)
	}
	return nil
}

// SlotInfo is a slot's row in pg_replication_slots.
type SlotInfo struct {
	Exists         bool
	Plugin         string
	Database       string
	Active         bool
	ActivePID      int32
	ConfirmedFlush pglogrepl.LSN
	RestartLSN     pglogrepl.LSN
	WALStatus      string // reserved, extended, unreserved, lost
	// InvalidationReason is why PostgreSQL invalidated the slot (empty: it
	// did not): wal_removed, rows_removed, wal_level_insufficient, and on
	// 18 idle_timeout (idle_replication_slot_timeout). 17 and 18 name it
	// invalidation_reason, 16 conflict_reason (logical slots on a standby
	// only); 15 says only wal_status lost.
	InvalidationReason string
}

// IdleSlotTimeout is the server's idle_replication_slot_timeout (18+): a
// slot no one streamed for longer is invalidated at a checkpoint. 0: off,
// or a server before 18.
func IdleSlotTimeout(ctx context.Context, q Querier) (time.Duration, error) {
	var secs int64
	err := q.QueryRow(ctx, `SELECT coalesce((SELECT setting::bigint FROM pg_catalog.pg_settings WHERE name = 'idle_replication_slot_timeout'), 0)`).Scan(&secs)
	if err != nil {
		return 0, fmt.Errorf("read idle_replication_slot_timeout: %w", err)
	}
	return time.Duration(secs) * time.Second, nil
}

// Invalidated reports whether the slot can never stream again.
func (si SlotInfo) Invalidated() bool {
	return si.Exists && (si.WALStatus == "lost" || si.InvalidationReason != "")
}

// LookupSlot reads a slot's state.
func LookupSlot(ctx context.Context, q Querier, name string) (SlotInfo, error) {
	var si SlotInfo
	var plugin, db, walStatus, reason *string
	var pid *int32
	var confirmed, restart *string
	// The reason's column differs by version; read through to_jsonb so one
	// statement serves every version.
	err := q.QueryRow(ctx, `SELECT plugin, database, active, active_pid, confirmed_flush_lsn::text, restart_lsn::text, wal_status,
			coalesce(to_jsonb(s)->>'invalidation_reason', to_jsonb(s)->>'conflict_reason')
		FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1`, name).
		Scan(&plugin, &db, &si.Active, &pid, &confirmed, &restart, &walStatus, &reason)
	if errors.Is(err, pgx.ErrNoRows) {
		return SlotInfo{}, nil
	}
	if err != nil {
		return SlotInfo{}, fmt.Errorf("look up slot %s: %w", name, err)
	}
	si.Exists = true
	si.Plugin, si.Database, si.WALStatus, si.InvalidationReason = deref(plugin), deref(db), deref(walStatus), deref(reason)
	if pid != nil {
		si.ActivePID = *pid
	}
	if confirmed != nil {
		if si.ConfirmedFlush, err = pglogrepl.ParseLSN(*confirmed); err != nil {
			return SlotInfo{}, fmt.Errorf("slot %s: parse confirmed_flush_lsn: %w", name, err)
		}
	}
	if restart != nil {
		if si.RestartLSN, err = pglogrepl.ParseLSN(*restart); err != nil {
			return SlotInfo{}, fmt.Errorf("slot %s: parse restart_lsn: %w", name, err)
		}
	}
	return si, nil
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// CreatedSlot is what CREATE_REPLICATION_SLOT returned.
type CreatedSlot struct {
	ConsistentPoint pglogrepl.LSN
	// Snapshot is the exported snapshot of the moment the slot became
	// consistent: rows visible in it are exactly those the slot will never
	// stream. It lives only until the next command on the replication
	// connection, so read it (SET TRANSACTION SNAPSHOT) before starting.
	Snapshot string
}

// CreateSlot creates a permanent pgoutput slot. Never temporary: a temporary
// slot vanishes with its connection and so does the position.
//
// failover (PostgreSQL 17+) makes it a failover slot: standbys with
// sync_replication_slots keep a copy, which survives a promotion (G14). The
// option must be part of CREATE_REPLICATION_SLOT itself: any other command
// on this connection before the backfill read the exported snapshot would
// destroy it, and pglogrepl's options have no FAILOVER.
func CreateSlot(ctx context.Context, conn *pgconn.PgConn, name string, failover bool) (CreatedSlot, error) {
	if !failover {
		res, err := pglogrepl.CreateReplicationSlot(ctx, conn, name, "pgoutput", pglogrepl.CreateReplicationSlotOptions{
			Mode:           pglogrepl.LogicalReplication,
			SnapshotAction: "EXPORT_SNAPSHOT",
		})
		if err != nil {
			return CreatedSlot{}, fmt.Errorf("create replication slot %s: %w", name, err)
		}
		return createdSlot(name, res.ConsistentPoint, res.SnapshotName)
	}
	results, err := conn.Exec(ctx, fmt.Sprintf(`CREATE_REPLICATION_SLOT %s LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)`,
		pgx.Identifier{name}.Sanitize())).ReadAll()
	if err != nil {
		return CreatedSlot{}, fmt.Errorf("create failover replication slot %s: %w", name, err)
	}
	if len(results) != 1 || len(results[0].Rows) != 1 || len(results[0].Rows[0]) < 3 {
		return CreatedSlot{}, fmt.Errorf("create failover replication slot %s: unexpected result %v", name, results)
	}
	row := results[0].Rows[0]
	return createdSlot(name, string(row[1]), string(row[2]))
}

func createdSlot(name, consistentPoint, snapshot string) (CreatedSlot, error) {
	lsn, err := pglogrepl.ParseLSN(consistentPoint)
	if err != nil {
		return CreatedSlot{}, fmt.Errorf("create replication slot %s: parse consistent point %q: %w", name, consistentPoint, err)
	}
	return CreatedSlot{ConsistentPoint: lsn, Snapshot: snapshot}, nil
}

// EnableFailover turns an existing slot into a failover slot (PostgreSQL
// 17+). It fails while another connection streams the slot.
func EnableFailover(ctx context.Context, conn *pgconn.PgConn, name string) error {
	if _, err := conn.Exec(ctx, fmt.Sprintf(`ALTER_REPLICATION_SLOT %s (FAILOVER true)`, pgx.Identifier{name}.Sanitize())).ReadAll(); err != nil {
		return fmt.Errorf("make slot %s a failover slot: %w", name, err)
	}
	return nil
}

// SlotLag reads how much WAL the slot holds (the server's WAL position minus
// its confirmed_flush_lsn) from the catalog, so an instance that is not
// streaming the slot can still report it. found is false when the slot does
// not exist.
func SlotLag(ctx context.Context, q Querier, name string) (lag int64, found bool, err error) {
	err = q.QueryRow(ctx, `SELECT coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint
		FROM pg_catalog.pg_replication_slots WHERE slot_name = $1`, name).Scan(&lag)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read lag of slot %s: %w", name, err)
	}
	return max(lag, 0), true, nil
}

// DropSlot drops an inactive slot. Used only for a slot PostgreSQL
// invalidated (wal_status lost), which can never stream again.
func DropSlot(ctx context.Context, q Querier, name string) error {
	if _, err := q.Exec(ctx, `SELECT pg_catalog.pg_drop_replication_slot($1)`, name); err != nil {
		return fmt.Errorf("drop invalidated slot %s: %w", name, err)
	}
	return nil
}

// IsSlotActive reports PostgreSQL's "replication slot is active for PID"
// (55006): another instance streams the slot.
func IsSlotActive(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgerrcode.ObjectInUse
}

// IsDuplicateObject reports 42710, e.g. a slot created concurrently.
func IsDuplicateObject(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == pgerrcode.DuplicateObject
}

// PgConn is a replication connection.
type PgConn = *pgconn.PgConn
