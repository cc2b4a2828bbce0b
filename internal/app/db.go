package app

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/replication"
)

// Poolers --database-pooler names.
const (
	PoolerNone        = "none"
	PoolerTransaction = "transaction"
)

// DB is how every command reaches PostgreSQL for its statements: the one
// place a connection's configuration is built (its password, its name in
// pg_stat_activity, its text encoding, and what a pooler in front of the
// server allows), so that what works for run works for every command.
type DB struct {
	URL      string
	Password DBPassword
	// Pooler is PoolerTransaction when URL reaches a pooler in transaction
	// mode (PgBouncer's pool_mode = transaction, a managed service's pooled
	// endpoint): a server connection serves the client for one transaction
	// at a time, so nothing may rely on session state. Statements then run
	// unprepared (pgx's QueryExecModeExec: one round trip, an unnamed
	// statement, no cache of named ones, which PgBouncer before 1.21 cannot
	// route), no setting goes in the startup packet but those the pooler
	// tracks, and migrate takes transaction-level locks.
	Pooler string
}

// DB is the database the statements of o go to.
func (o *Options) DB() DB {
	return DB{URL: o.DatabaseURL, Password: o.DBPassword, Pooler: o.Pooler}
}

// Pooled reports whether the statements go through a transaction pooler.
func (d DB) Pooled() bool { return d.Pooler == PoolerTransaction }

// Validate refuses an unknown pooler and the password's own errors.
func (d DB) Validate() error {
	switch d.Pooler {
	case "", PoolerNone, PoolerTransaction:
	default:
		return fmt.Errorf("--database-pooler %q: want none (--database-url reaches PostgreSQL, or a pooler in session mode) or transaction (PgBouncer's pool_mode = transaction, a managed service's pooled endpoint)", d.Pooler)
	}
	if _, err := pgconn.ParseConfig(d.URL); err != nil {
		return fmt.Errorf("parse --database-url: %w", redactErr(err, d.URL))
	}
	return d.Password.Validate()
}

// Target names the server and database, without credentials, for logs.
func (d DB) Target() string { return dbTarget(d.URL) }

// poolConfig is the pool's configuration, named appName (default
// outbox-relay) in pg_stat_activity.
func (d DB) poolConfig(appName string) (*pgxpool.Config, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	pcfg, err := pgxpool.ParseConfig(d.URL)
	if err != nil {
		return nil, fmt.Errorf("parse --database-url: %w", redactErr(err, d.URL))
	}
	if appName == "" {
		appName = "outbox-relay"
	}
	pcfg.ConnConfig.RuntimeParams["application_name"] = appName
	d.pooled(pcfg.ConnConfig)
	// Text in UTF-8, what messages carry (replication.PinClientEncoding).
	// A pooler tracks client_encoding for its client and sets it on each
	// server connection it lends, so the SET holds behind one too.
	pcfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		return replication.PinClientEncoding(ctx, c.PgConn())
	}
	d.Password.Apply(pcfg)
	return pcfg, nil
}

// pooled makes one connection's configuration safe behind a transaction
// pooler.
func (d DB) pooled(cc *pgx.ConnConfig) {
	if !d.Pooled() {
		return
	}
	cc.DefaultQueryExecMode = pgx.QueryExecModeExec
	cc.StatementCacheCapacity = 0
	cc.DescriptionCacheCapacity = 0
}

// Pool opens a pool for a command, named appName in pg_stat_activity.
func (d DB) Pool(ctx context.Context, appName string) (*pgxpool.Pool, error) {
	pcfg, err := d.poolConfig(appName)
	if err != nil {
		return nil, err
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL at %s: %w", d.Target(), redactErr(err, d.URL))
	}
	return pool, nil
}

// ObserverPool opens a pool with the observer bounds, for what only looks
// (status, the console, the table metrics): they run on a server the relay
// uses too, and nothing they ask may run longer than
// ObserverStatementTimeout or on more than ObserverMaxConns connections.
// Behind a transaction pooler the statement bound cannot go in the startup
// packet (PgBouncer refuses a connection that carries it), so it is the
// pooler's (query_timeout) or the role's (ALTER ROLE ... SET
// statement_timeout): docs/managed-postgresql.md.
func (d DB) ObserverPool(ctx context.Context, appName string) (*pgxpool.Pool, error) {
	pcfg, err := d.poolConfig(appName)
	if err != nil {
		return nil, err
	}
	if !d.Pooled() {
		pcfg.ConnConfig.RuntimeParams["statement_timeout"] = strconv.FormatInt(ObserverStatementTimeout.Milliseconds(), 10)
	}
	pcfg.MaxConns = ObserverMaxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("open the console's and metrics' pool: %w", redactErr(err, d.URL))
	}
	return pool, nil
}

// Conn opens one connection for a command that runs statements in order on
// it (migrate).
func (d DB) Conn(ctx context.Context) (*pgx.Conn, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	cfg, err := pgx.ParseConfig(d.URL)
	if err != nil {
		return nil, fmt.Errorf("parse --database-url: %w", redactErr(err, d.URL))
	}
	d.pooled(cfg)
	if d.Password.Set() {
		if cfg.Password, err = d.Password.For(ctx, cfg.Host, cfg.Port, cfg.User); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to PostgreSQL at %s: %w", d.Target(), redactErr(err, d.URL))
	}
	return conn, nil
}

// Observer pool bounds: the console and the table metrics run on their own
// few connections, each statement cut off after ObserverStatementTimeout, so
// nothing a dashboard or an operator's preview does (a whole-table count, a
// wait on a locked row, ten browser tabs) can take a connection the marks,
// settles and claims need, or hold one for long (G16).
const (
	ObserverMaxConns         = 3
	ObserverStatementTimeout = 10 * time.Second
)

// dbTarget names a connection string's server and database, without
// credentials, for the log.
func dbTarget(url string) string {
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return "(unparsable)"
	}
	return fmt.Sprintf("%s:%d/%s as %s", cfg.Host, cfg.Port, cfg.Database, cfg.User)
}
