package main

import (
	"context"
	"io"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

func runCancel(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o opFlags
	fs := newFlagSet("cancel", `Stops scheduled or failed rows: they move to cancelled (terminal until a redrive), with who,
when and why recorded on the row and in the <table>_redrives history. Ready rows are already on
their way through the CDC path and running rows are held by a worker: both are refused.

  outbox-relay cancel --reason "order withdrawn" --work-id w1
  outbox-relay cancel --reason "bad deploy 1.4.2" --state scheduled --kind invoice.sent --since 2h`, stderr)
	o.register(fs, store.ActionCancel, flagDatabaseURL, flagTable)
	if err := parse(fs, args); err != nil {
		return err
	}
	req, err := o.request(fs, store.ActionCancel)
	if err != nil {
		return err
	}
	st, closeDB, err := openStore(ctx, &o.common)
	if err != nil {
		return err
	}
	defer closeDB()
	res, err := st.Cancel(ctx, req)
	if err != nil {
		return err
	}
	report(stdout, st.Table(), req, res)
	return refusedErr(res, req)
}
