package main

import (
	"context"
	"io"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/demo"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	var natsServer string
	fs := newFlagSet("demo", "Shows rows flowing end to end. Without --database-url / --nats-url it starts a throwaway PostgreSQL (wal_level=logical) and nats-server and removes them afterwards.", stderr)
	c.register(fs, commonFlags...) // the demo runs the relay: it reads them all
	// Its environment variable, OUTBOX_RELAY_NATS_SERVER, is how the
	// error for a missing nats-server tells people to name theirs.
	fs.StringVar(&natsServer, "nats-server", "", "nats-server binary for the throwaway server (default: the version go.mod pins when run in a source checkout, else nats-server on PATH)")
	if err := parse(fs, args); err != nil {
		return err
	}
	// The demo's URL defaults are "start one", unlike run's.
	if !flagGiven(fs, flagNATSURL) {
		c.natsURL = ""
	}
	log, err := c.log.Logger(stderr)
	if err != nil {
		return err
	}
	if c.log.Level == "info" && !flagGiven(fs, flagLogLevel) {
		// The demo's own lines tell the story; the relay's warnings and
		// errors still show.
		log = log.Level(zerolog.WarnLevel)
	}
	o, err := c.options()
	if err != nil {
		return err
	}
	return demo.Run(ctx, demo.Options{Relay: o, NATSServer: natsServer}, stdout, log)
}
