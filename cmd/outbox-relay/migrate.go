package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/termsafe"
	"github.com/outbox-relay/outbox-relay/replication"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	var inboxTable string
	var printGrants bool
	var roles schema.Roles
	fs := newFlagSet("migrate", "Creates or upgrades the outbox table and its indexes (versioned, idempotent, safe to run concurrently and beside producers: indexes are built concurrently, and no lock their INSERTs queue behind is waited for longer than --lock-timeout) and the insert-only publication. Run it as the table's owner: any other role, a superuser included, is refused (docs/security.md, \"migrate runs as the table's owner\").\n"+
		"With --inbox, creates a consumer's inbox tables (package inbox) instead, usually in the consumer's own database.", stderr)
	var recordSettings bool
	var ordering string
	var lockTimeout time.Duration
	c.register(fs, flagDatabaseURL, flagTable, flagPublication, flagOnPublish)
	fs.BoolVar(&recordSettings, "record-settings", false, "record --ordering and --on-publish as the table's settings, which every `run` of it must use (stop every instance first: docs/upgrading.md, \"Changing --ordering or --on-publish\"); without it, migrate prints the recorded ones")
	fs.StringVar(&ordering, "ordering", app.OrderingNone, "with --record-settings: the table's --ordering, none or aggregate")
	fs.DurationVar(&lockTimeout, "lock-timeout", schema.DefaultLockTimeout, "longest wait for a lock that producers' INSERTs queue behind (PostgreSQL lock_timeout); past it migrate gives up, names the session holding the table, and a rerun resumes (docs/upgrading.md, \"Migrating a large table\")")
	var partitionInterval, payloadType string
	fs.StringVar(&payloadType, "payload-type", "", "create a NEW table whose payload column is jsonb (the default: PostgreSQL normalises key order and spacing), json (the producer's JSON text, published byte for byte) or bytea (any bytes, e.g. Protobuf or Avro, published byte for byte); on an existing table it must name the column's type (docs/message-formats.md, \"Payload types\")")
	fs.StringVar(&partitionInterval, "partition-interval", "", "create a NEW table partitioned by created_at in ranges of this interval (1h, 1d, Nd, or a Go duration of at least 5m in whole minutes); prune then drops whole partitions. Refused on an existing plain table (docs/partitions.md, \"Converting a plain table to a partitioned one\")")
	fs.StringVar(&inboxTable, "inbox", "", "create the inbox table with this name (name or schema.name) and its <name>_fences table for consumers using package inbox, instead of the outbox table and publication")
	fs.BoolVar(&printGrants, "print-grants", false, "print the least-privilege roles and grants (sql/roles.sql) for --table and exit; run the output as the table's owner")
	fs.StringVar(&roles.Relay, "relay-role", "outbox_relay", "with --print-grants: the relay's role (LOGIN REPLICATION)")
	fs.StringVar(&roles.Producer, "producer-role", "outbox_producer", "with --print-grants: the application role that inserts outbox rows")
	fs.StringVar(&roles.Operator, "operator-role", "outbox_operator", "with --print-grants: the role that runs status, redrive, cancel and prune")
	if err := parse(fs, args); err != nil {
		return err
	}
	if lockTimeout <= 0 {
		return fmt.Errorf("--lock-timeout %s: want more than 0 (0 would let producers queue behind migrate for as long as another session holds the table)", lockTimeout)
	}
	if printGrants {
		if inboxTable != "" {
			return fmt.Errorf("--print-grants and --inbox: choose one")
		}
		t, err := store.ParseTable(c.table)
		if err != nil {
			return err
		}
		sql, err := schema.Grants(t, roles)
		if err != nil {
			return err
		}
		_, err = io.WriteString(stdout, sql)
		return err
	}
	if inboxTable != "" {
		return migrateInbox(ctx, c.db(), inboxTable, stdout)
	}
	t, err := store.ParseTable(c.table)
	if err != nil {
		return err
	}
	if payloadType != "" {
		if err := schema.ValidatePayloadType(payloadType); err != nil {
			return err
		}
	}
	var interval time.Duration
	if partitionInterval != "" {
		if interval, err = schema.ParsePartitionInterval(partitionInterval); err != nil {
			return err
		}
	}
	if err := replication.ValidateName("publication", c.publication); err != nil {
		return err
	}
	conn, err := c.db().Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	applied, err := schema.MigrateWith(ctx, conn, t, schema.MigrateOptions{
		LockTimeout:       lockTimeout,
		Progress:          func(msg string) { fmt.Fprintf(stdout, "%s: %s\n", t.Qualified(), msg) },
		PartitionInterval: interval,
		PayloadType:       payloadType,
		Pooled:            c.db().Pooled(),
	})
	// Each migration is committed on its own: say which ones are in even
	// when a later one failed, so that the rerun's output makes sense.
	for _, m := range applied {
		fmt.Fprintf(stdout, "applied %04d_%s to %s\n", m.Version, m.Name, t.Qualified())
	}
	if err != nil {
		return err
	}
	if len(applied) == 0 {
		fmt.Fprintf(stdout, "%s is up to date\n", t.Qualified())
	}
	layout, err := schema.ReadLayout(ctx, conn, t)
	if err != nil {
		return err
	}
	if layout.Partitioned() {
		made, err := store.AddPartitions(ctx, conn, t, lockTimeout)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "%s is partitioned by created_at every %s, %d intervals created ahead%s\n",
			t.Qualified(), layout.PartitionInterval, schema.PartitionsAhead(layout.PartitionInterval), made.Describe())
	}
	pub, err := replication.EnsurePublication(ctx, conn, c.publication, t.Schema, t.Name)
	if err != nil {
		return err
	}
	if !pub.Filtered {
		if err := replication.FilterPublication(ctx, conn, c.publication, t.Schema, t.Name); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "publication %s: added the row filter WHERE %s\n", c.publication, replication.ReadyFilter)
	}
	fmt.Fprintf(stdout, "publication %s publishes inserts of ready rows on %s\n", c.publication, t.Qualified())
	if recordSettings {
		return recordTableSettings(ctx, conn, t, ordering, c.onPublish, stdout)
	}
	rec, found, err := store.ReadSettings(ctx, conn, t)
	if err != nil {
		return err
	}
	if found {
		fmt.Fprintf(stdout, "settings of %s: %s (recorded by %s at %s); every instance of it must run with them\n",
			t.Qualified(), rec.Flags(), termsafe.String(rec.RecordedBy), rec.RecordedAt.UTC().Format(time.RFC3339))
	} else {
		fmt.Fprintf(stdout, "settings of %s: none recorded yet; the first `run` records its --ordering and --on-publish\n", t.Qualified())
	}
	return nil
}

// recordTableSettings replaces the table's recorded --ordering and
// --on-publish. Instances already running keep what they started with; the
// next start of each is checked against the new record.
func recordTableSettings(ctx context.Context, conn *pgx.Conn, t store.Table, ordering, onPublish string, stdout io.Writer) error {
	switch ordering {
	case app.OrderingNone, app.OrderingAggregate:
	default:
		return fmt.Errorf("--ordering %q: want none or aggregate", ordering)
	}
	policy, err := store.ParsePolicy(onPublish)
	if err != nil {
		return err
	}
	host, _ := os.Hostname()
	s := store.Settings{Ordering: ordering, OnPublish: policy}
	prev, found, err := store.RecordSettings(ctx, conn, t, s, "migrate --record-settings on "+host)
	if err != nil {
		return err
	}
	was := "none recorded"
	if found {
		was = fmt.Sprintf("%s, recorded by %s at %s", prev.Flags(), termsafe.String(prev.RecordedBy), prev.RecordedAt.UTC().Format(time.RFC3339))
	}
	fmt.Fprintf(stdout, "recorded the settings of %s: %s (were: %s)\n", t.Qualified(), s.Flags(), was)
	fmt.Fprintf(stdout, "start every instance of %s with %s; an instance that was running keeps its old settings until it is restarted\n", t.Qualified(), s.Flags())
	return nil
}

// migrateInbox creates a consumer's inbox tables. It touches neither the
// outbox table nor the publication: the inbox lives where the consumer's
// effects live, normally another database.
func migrateInbox(ctx context.Context, db app.DB, table string, stdout io.Writer) error {
	conn, err := db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if err := inbox.Migrate(ctx, conn, table); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "inbox table %s and its fences table are in place\n", table)
	return nil
}
