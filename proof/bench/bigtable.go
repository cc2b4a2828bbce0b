package bench

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/proof/bigtable"
)

// BigTable is G16's case (proof/bigtable): a table of -bigtable-rows
// published rows with one dead letter holding an aggregate, the relay with
// --ordering aggregate and its console polled, a 20 rows/s trickle for
// -bigtable-seconds; it reports the table's sequential scans in that window,
// the trickle's p99 and every statement's calls and latency. Run only when
// named in -cases: at its default size the preload alone takes minutes.
const BigTable = "bigtable"

func init() { extraCases[BigTable] = (*bench).bigTable }

// bigTable runs the case on a PostgreSQL of its own (fsync on, as the
// benchmark's): pg_stat_statements and auto_explain must be preloaded, and
// the 20 million rows are dropped with the server.
func (b *bench) bigTable(ctx context.Context, rep *Report) error {
	logDir, err := bigtable.LogDir()
	if err != nil {
		return err
	}
	if !b.cfg.Keep {
		defer os.RemoveAll(logDir)
	}
	b.cfg.logf("%s: starting its own PostgreSQL (fsync on, pg_stat_statements, auto_explain)", BigTable)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Fsync: true, Conf: bigtable.ServerConf(logDir)})
	if err != nil {
		return err
	}
	defer pg.Close()
	url, err := createDatabase(ctx, pg, "bigtable")
	if err != nil {
		return err
	}
	res, err := bigtable.Run(ctx, bigtable.Config{
		DBURL: url, PGLog: bigtable.LogPath(logDir), NATSURL: b.s.nats.URL(),
		RelayBin: b.cfg.RelayBin, RelayEnv: b.cfg.RelayEnv, Dir: b.dir,
		Rows: b.cfg.BigTableRows, Window: time.Duration(b.cfg.BigTableSeconds * float64(time.Second)),
		Logf: func(format string, args ...any) { b.cfg.logf(BigTable+": "+format, args...) },
	})
	if err != nil {
		return fmt.Errorf("%s: %w", BigTable, err)
	}
	rep.BigTable = &res
	return nil
}

func createDatabase(ctx context.Context, pg *testenv.Postgres, name string) (string, error) {
	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return "", fmt.Errorf("connect to postgres: %w", err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return pg.URL(name), nil
}

// renderBigTable prints the case's figures and statements.
func renderBigTable(r *bigtable.Result) string {
	return fmt.Sprintf("\n%s (G16; figures are floors on a shared 2-core machine):\n%s", BigTable, r.Table())
}
