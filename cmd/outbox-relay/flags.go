package main

import (
	"flag"
	"io"
	"os"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

// common are the flags every command that touches the database shares.
type common struct {
	databaseURL   string
	natsURL       string
	table         string
	slot          string
	publication   string
	stream        string
	subjectPrefix string
	onPublish     string
	log           config.Logging
}

func (c *common) register(fs *flag.FlagSet, withNATS bool) {
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL URL or key=value string; empty uses the libpq variables (PGHOST, PGUSER, PGPASSWORD, ...)")
	fs.StringVar(&c.table, "table", "outbox", "outbox table: name or schema.name")
	fs.StringVar(&c.slot, "slot", "outbox_relay", "logical replication slot")
	fs.StringVar(&c.publication, "publication", "outbox_relay", "publication of the outbox table's inserts")
	if withNATS {
		fs.StringVar(&c.natsURL, "nats-url", "nats://127.0.0.1:4222", "NATS server URL(s), comma-separated")
		fs.StringVar(&c.stream, "stream", "OUTBOX", "JetStream stream; created when missing, never changed")
		fs.StringVar(&c.subjectPrefix, "subject-prefix", "outbox.", "default subject is <prefix><kind>; the stream binds <prefix>>")
		fs.StringVar(&c.onPublish, "on-publish", "mark", "after the broker's ack: mark (state=published, keep evidence) or delete")
	}
	c.log.Register(fs)
}

func newFlagSet(name, summary string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = config.Usage(fs, stderr, "usage: outbox-relay "+name+" [flags]\n\n"+summary)
	return fs
}

func parse(fs *flag.FlagSet, args []string) error {
	return config.Parse(fs, args, os.LookupEnv)
}

// options turns the common flags into app.Options with the defaults of the
// design; run adds its own on top.
func (c *common) options() (app.Options, error) {
	t, err := store.ParseTable(c.table)
	if err != nil {
		return app.Options{}, err
	}
	o := app.Options{
		DatabaseURL:      c.databaseURL,
		NATSURL:          c.natsURL,
		Table:            t,
		Slot:             c.slot,
		Publication:      c.publication,
		Stream:           c.stream,
		SubjectPrefix:    c.subjectPrefix,
		DuplicateWindow:  2 * time.Minute,
		AckTimeout:       10 * time.Second,
		MaxInFlight:      1024,
		MaxInFlightBytes: 4 << 20,
		StatusInterval:   2 * time.Second,
		DrainTimeout:     10 * time.Second,
	}
	if c.onPublish != "" {
		if o.Policy, err = store.ParsePolicy(c.onPublish); err != nil {
			return app.Options{}, err
		}
	}
	return o, nil
}

func flagGiven(fs *flag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	if _, ok := os.LookupEnv(config.EnvName(name)); ok {
		given = true
	}
	return given
}
