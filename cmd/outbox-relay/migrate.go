package main

import (
	"context"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("migrate", "Creates or upgrades the outbox table and its indexes (versioned, idempotent, safe to run concurrently) and the insert-only publication.", stderr)
	c.register(fs, false)
	if err := parse(fs, args); err != nil {
		return err
	}
	t, err := store.ParseTable(c.table)
	if err != nil {
		return err
	}
	if err := replication.ValidateName("publication", c.publication); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, c.databaseURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer conn.Close(context.Background())
	applied, err := store.Migrate(ctx, conn, t)
	if err != nil {
		return err
	}
	for _, m := range applied {
		fmt.Fprintf(stdout, "applied %04d_%s to %s\n", m.Version, m.Name, t.Qualified())
	}
	if len(applied) == 0 {
		fmt.Fprintf(stdout, "%s is up to date\n", t.Qualified())
	}
	if err := replication.EnsurePublication(ctx, conn, c.publication, t.Schema, t.Name); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "publication %s publishes inserts on %s\n", c.publication, t.Qualified())
	return nil
}
