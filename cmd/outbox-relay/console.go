package main

import (
	"context"
	"io"
	"net"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/console"
)

func runConsole(ctx context.Context, args []string, _, stderr io.Writer) error {
	var c common
	fs := newFlagSet("console", `Serves the operator console under /ui/ without streaming or polling: health, dead letters with their
evidence, redrive and cancel (the same statements as the CLI's), and their history. For operators who
must not touch the running relay; its role shows "console only".

  outbox-relay console --http-addr 127.0.0.1:8081
  OUTBOX_RELAY_CONSOLE_TOKEN=... outbox-relay console --http-addr :8081`, stderr)
	c.register(fs, flagDatabaseURL, flagTable, flagSlot, flagLogLevel, flagLogFormat)
	var (
		o            console.Options
		addr         string
		standbySlots config.List
	)
	o.Enabled = true
	fs.StringVar(&addr, "http-addr", "127.0.0.1:8081", "serve the console here, under /ui/; an address other than loopback needs --console-token")
	fs.StringVar(&o.Token, "console-token", "", "the console's token (bearer, basic auth password or login), at least 16 bytes; required unless --http-addr is loopback, and without it the console is read-only and answers only requests addressed to localhost")
	fs.BoolVar(&o.ReadOnly, "console-read-only", false, "the console shows everything and changes nothing")
	fs.Var(&standbySlots, "standby-slot", "the physical slots of the standbys run waits for (run --standby-slot): show how far behind each is")
	if err := parse(fs, args); err != nil {
		return err
	}
	log, err := c.log.Logger(stderr)
	if err != nil {
		return err
	}
	// Before connecting: a console that may not serve must not wait for a
	// database first.
	if err := console.CheckToken(o.Token); err != nil {
		return err
	}
	if err := console.CheckAddr(addr, o.Token); err != nil {
		return err
	}
	st, closeDB, err := openObserverStore(ctx, &c, "outbox-relay console")
	if err != nil {
		return err
	}
	defer closeDB()
	src := console.Sources{Store: st, Catalog: st.Pool(), Slot: c.slot}
	if len(standbySlots) > 0 {
		src.Standbys = console.StandbysFromCatalog(st.Pool(), standbySlots)
	}
	ui, err := console.New(o, addr, src)
	if err != nil {
		return err
	}
	return app.ServeConsole(ctx, addr, ui, func(a net.Addr) {
		log.Info().Str("addr", a.String()).Bool("read_only", !o.Writable()).Msg("serving the console under /ui/")
	})
}
