package main

import (
	"context"
	"io"
	"os"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/demo"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	var natsServer string
	fs := newFlagSet("demo", "Shows rows flowing end to end, then order per aggregate (--ordering aggregate) with one order held behind its refused row, a deadline passing into expired, a dead letter redriven, and (on a terminal, or with --console) the operator console until Ctrl-C. Without --database-url / --nats-url it starts a throwaway PostgreSQL (wal_level=logical) and nats-server and removes them afterwards.", stderr)
	c.register(fs, commonFlags...) // the demo runs the relay: it reads them all
	// Its environment variable, OUTBOX_RELAY_NATS_SERVER, is how the
	// error for a missing nats-server tells people to name theirs.
	fs.StringVar(&natsServer, "nats-server", "", "nats-server binary for the throwaway server (default: the version go.mod pins when run in a source checkout, else nats-server on PATH)")
	terminal := isTerminal(stdout)
	var withConsole bool
	var consoleAddr string
	fs.BoolVar(&withConsole, "console", false, "end by serving the operator console, with a token printed for the session, until Ctrl-C (default: when stdout is a terminal)")
	fs.StringVar(&consoleAddr, "http-addr", "127.0.0.1:0", "serve the console here (loopback; port 0 picks a free one)")
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
	if !flagGiven(fs, "console") {
		withConsole = terminal
	}
	return demo.Run(ctx, demo.Options{Relay: o, NATSServer: natsServer, Terminal: terminal,
		Console: withConsole, ConsoleAddr: consoleAddr}, stdout, log)
}

// isTerminal says w is a character device, where overwriting a progress
// line makes sense; a file or a pipe gets plain lines.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
