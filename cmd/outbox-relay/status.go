package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

type statusReport struct {
	Table string `json:"table"`
	Slot  struct {
		Name         string `json:"name"`
		Exists       bool   `json:"exists"`
		Active       bool   `json:"active"`
		ActivePID    int32  `json:"active_pid,omitempty"`
		ConfirmedLSN string `json:"confirmed_lsn,omitempty"`
		LagBytes     int64  `json:"lag_bytes"`
		WALStatus    string `json:"wal_status,omitempty"`
	} `json:"slot"`
	store.Counts
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("status", "Prints the slot's lag, rows by state, the oldest eligible row's age and failures by reason.", stderr)
	c.register(fs, false)
	asJSON := fs.Bool("json", false, "print JSON for machines")
	if err := parse(fs, args); err != nil {
		return err
	}
	t, err := store.ParseTable(c.table)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, c.databaseURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	st := store.New(pool, t, store.PolicyMark)
	if err := st.Check(ctx); err != nil {
		return err
	}
	var rep statusReport
	rep.Table = t.Qualified()
	rep.Slot.Name = c.slot
	slot, err := replication.LookupSlot(ctx, pool, c.slot)
	if err != nil {
		return err
	}
	rep.Slot.Exists, rep.Slot.Active, rep.Slot.ActivePID, rep.Slot.WALStatus = slot.Exists, slot.Active, slot.ActivePID, slot.WALStatus
	if slot.Exists {
		rep.Slot.ConfirmedLSN = slot.ConfirmedFlush.String()
		var cur string
		if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&cur); err != nil {
			return fmt.Errorf("read current WAL position: %w", err)
		}
		if lsn, err := pglogrepl.ParseLSN(cur); err == nil && lsn > slot.ConfirmedFlush {
			rep.Slot.LagBytes = int64(lsn - slot.ConfirmedFlush)
		}
	}
	if rep.Counts, err = st.Counts(ctx); err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	fmt.Fprintf(stdout, "table      %s\n", rep.Table)
	if !slot.Exists {
		fmt.Fprintf(stdout, "slot       %s: missing (created by `outbox-relay run`)\n", c.slot)
	} else {
		owner := "inactive"
		if slot.Active {
			owner = fmt.Sprintf("active (pid %d)", slot.ActivePID)
		}
		fmt.Fprintf(stdout, "slot       %s: %s, confirmed %s, lag %d bytes, wal_status %s\n",
			c.slot, owner, rep.Slot.ConfirmedLSN, rep.Slot.LagBytes, slot.WALStatus)
	}
	fmt.Fprintf(stdout, "rows       ")
	for _, s := range []string{"ready", "scheduled", "running", "published", "failed", "cancelled"} {
		fmt.Fprintf(stdout, "%s=%d ", s, rep.ByState[s])
	}
	fmt.Fprintf(stdout, "\noldest eligible row: %.1fs\n", rep.OldestEligibleSeconds)
	if len(rep.FailedByReason) > 0 {
		fmt.Fprintln(stdout, "failed by reason:")
		reasons := make([]string, 0, len(rep.FailedByReason))
		for r := range rep.FailedByReason {
			reasons = append(reasons, r)
		}
		sort.Strings(reasons)
		for _, r := range reasons {
			fmt.Fprintf(stdout, "  %-40s %d\n", r, rep.FailedByReason[r])
		}
	}
	return nil
}
