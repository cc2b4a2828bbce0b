package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"slices"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/nats-io/nats.go"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// The common flags: every command accepts all of them, so one set of flags or
// one environment file serves every command, and each command names the ones
// it reads (register's uses); --help marks the rest ignored.
const (
	flagDatabaseURL   = "database-url"
	flagNATSURL       = "nats-url"
	flagTable         = "table"
	flagSlot          = "slot"
	flagPublication   = "publication"
	flagStream        = "stream"
	flagSubjectPrefix = "subject-prefix"
	flagOnPublish     = "on-publish"
	flagLogLevel      = "log-level"
	flagLogFormat     = "log-format"

	flagMessageFormat     = "message-format"
	flagCloudEventsSource = "cloudevents-source"

	flagDBPasswordFile    = "database-password-file"
	flagDBPasswordCommand = "database-password-command"
	flagDBPooler          = "database-pooler"
	flagDBIAM             = "database-iam"
	flagDBIAMRegion       = "database-iam-region"

	flagNATSName     = "nats-name"
	flagNATSUser     = "nats-user"
	flagNATSPassword = "nats-password"
	flagNATSToken    = "nats-token"
	flagNATSCreds    = "nats-creds"
	flagNATSNKey     = "nats-nkey"
	flagNATSTLSCA    = "nats-tls-ca"
	flagNATSTLSCert  = "nats-tls-cert"
	flagNATSTLSKey   = "nats-tls-key"
)

// natsFlags are the common flags that say how to reach and log in to the
// broker: a command that talks to NATS uses all of them, so the environment
// that lets run log in lets every command log in (OUTBOX_RELAY_NATS_USER,
// OUTBOX_RELAY_NATS_PASSWORD, ...).
var natsFlags = []string{flagNATSURL, flagNATSName, flagNATSUser, flagNATSPassword, flagNATSToken,
	flagNATSCreds, flagNATSNKey, flagNATSTLSCA, flagNATSTLSCert, flagNATSTLSKey}

// withNATS is uses plus natsFlags, for register.
func withNATS(uses ...string) []string { return append(slices.Clone(natsFlags), uses...) }

// commonFlags lists the common flags, the logging ones last.
var commonFlags = []string{flagDatabaseURL, flagDBPasswordFile, flagDBPasswordCommand, flagDBIAM, flagDBIAMRegion, flagDBPooler, flagNATSURL, flagNATSName, flagNATSUser, flagNATSPassword,
	flagNATSToken, flagNATSCreds, flagNATSNKey, flagNATSTLSCA, flagNATSTLSCert, flagNATSTLSKey,
	flagTable, flagSlot, flagPublication, flagStream, flagSubjectPrefix, flagOnPublish, flagMessageFormat, flagCloudEventsSource,
	flagLogLevel, flagLogFormat}

// common holds the common flags' values.
type common struct {
	databaseURL   string
	dbPassword    app.DBPassword
	dbPooler      string
	natsURL       string
	nats          app.NATSAuth
	table         string
	slot          string
	publication   string
	stream        string
	subjectPrefix string
	onPublish     string
	// messageFormat and ceSource: how rows become messages, for every
	// command that publishes (run, republish).
	messageFormat string
	ceSource      string
	log           config.Logging
}

// register adds every common flag to fs and marks those not in uses ignored.
// A command must check only the flags it uses: a value meant for another
// command (migrate --on-publish delete, version --table x.y.z) is no error.
func (c *common) register(fs *flag.FlagSet, uses ...string) {
	fs.StringVar(&c.databaseURL, flagDatabaseURL, "", "PostgreSQL URL or key=value string; empty uses the libpq variables (PGHOST, PGUSER, PGPASSWORD, ...)")
	fs.StringVar(&c.dbPassword.File, flagDBPasswordFile, "", "a file holding the database password, read again for every new connection (a Kubernetes Secret or Vault agent file that is rewritten when the password rotates); overrides the URL's password")
	fs.StringVar(&c.dbPassword.Command, flagDBPasswordCommand, "", "a command (run with /bin/sh -c for every new connection, at most 30s) whose first line of output is the database password: a short-lived token, e.g. aws rds generate-db-auth-token ...; overrides the URL's password")
	fs.StringVar(&c.dbPassword.IAM, flagDBIAM, "", "aws: sign an RDS/Aurora IAM authentication token as the password of every new connection (credentials from the standard AWS chain: environment, shared files, IRSA web identity, ECS and EC2 roles); the URL names the instance's endpoint and the database user")
	fs.StringVar(&c.dbPassword.IAMRegion, flagDBIAMRegion, "", "the AWS region of --database-iam aws's tokens (empty: AWS_REGION or the AWS profile's)")
	fs.StringVar(&c.dbPooler, flagDBPooler, app.PoolerNone, "what --database-url reaches: none (PostgreSQL, or a pooler in session mode) or transaction (PgBouncer's pool_mode = transaction, a managed service's pooled endpoint: statements unprepared, no session state; run then needs --replication-database-url for the slot)")
	fs.StringVar(&c.natsURL, flagNATSURL, "nats://127.0.0.1:4222", "NATS server URL(s), comma-separated")
	fs.StringVar(&c.nats.Name, flagNATSName, "", "NATS connection name (empty: outbox-relay, or outbox-relay <command> for the others)")
	fs.StringVar(&c.nats.User, flagNATSUser, "", "NATS user")
	fs.StringVar(&c.nats.Password, flagNATSPassword, "", "NATS password (prefer the variable OUTBOX_RELAY_NATS_PASSWORD: a flag shows in ps)")
	fs.StringVar(&c.nats.Token, flagNATSToken, "", "NATS token")
	fs.StringVar(&c.nats.CredsFile, flagNATSCreds, "", "NATS credentials file (JWT + NKey)")
	fs.StringVar(&c.nats.NKeyFile, flagNATSNKey, "", "NATS NKey seed file")
	fs.StringVar(&c.nats.CAFile, flagNATSTLSCA, "", "CA certificate for the broker's TLS")
	fs.StringVar(&c.nats.CertFile, flagNATSTLSCert, "", "client certificate for TLS")
	fs.StringVar(&c.nats.KeyFile, flagNATSTLSKey, "", "client key for TLS")
	fs.StringVar(&c.table, flagTable, "outbox", "outbox table: name or schema.name")
	fs.StringVar(&c.slot, flagSlot, "outbox_relay", "logical replication slot")
	fs.StringVar(&c.publication, flagPublication, "outbox_relay", "publication of the outbox table's inserts")
	fs.StringVar(&c.stream, flagStream, "OUTBOX", "JetStream stream the relay publishes to; run creates it when missing, never changes it")
	fs.StringVar(&c.subjectPrefix, flagSubjectPrefix, "outbox.", "default subject is <prefix><kind>; the stream binds <prefix>>")
	fs.StringVar(&c.onPublish, flagOnPublish, "mark", "after the broker's ack: mark (state=published, keep evidence), delete, or none (the CDC path writes nothing per row; a watermark in <table>_slots says what was published)")
	fs.StringVar(&c.messageFormat, flagMessageFormat, "outbox", "how a row becomes a message: outbox (the payload as the data, Outbox-* headers), cloudevents (also the CloudEvents attributes as ce-* headers: binary content mode) or cloudevents-structured (the data is an application/cloudevents+json envelope); Nats-Msg-Id and the Outbox-* headers stay in each (docs/consumers.md)")
	fs.StringVar(&c.ceSource, flagCloudEventsSource, "", "the CloudEvents source attribute (a URI-reference; empty: /outbox-relay/<database>/<schema>.<table>)")
	c.log.Register(fs)
	used := map[string]bool{}
	if slices.Contains(uses, flagDatabaseURL) {
		// The database's password and pooler go with its URL.
		uses = append(slices.Clone(uses), flagDBPasswordFile, flagDBPasswordCommand, flagDBIAM, flagDBIAMRegion, flagDBPooler)
	}
	for _, name := range uses {
		if !slices.Contains(commonFlags, name) {
			panic("register: --" + name + " is not a common flag")
		}
		used[name] = true
	}
	for _, name := range commonFlags {
		if !used[name] {
			config.Ignore(fs, name)
		}
	}
}

func newFlagSet(name, summary string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = config.Usage(fs, stderr, "usage: outbox-relay "+name+" [flags]\n\n"+summary, config.Groups{
		Order: append(slices.Clone(groupOrder), groupIgnored),
		Of: func(flag string) string {
			if f := fs.Lookup(flag); f != nil && config.Ignored(f) {
				return groupIgnored
			}
			return groupOf(name, flag)
		},
		Rank: func(flag string) int {
			if r, ok := rank[flag]; ok && (name == "run" || isCommon(flag)) {
				return r
			}
			return len(rank)
		},
	})
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
		DBPassword:       c.dbPassword,
		Pooler:           c.dbPooler,
		NATSURL:          c.natsURL,
		NATS:             c.nats,
		Table:            t,
		Slot:             c.slot,
		Publication:      c.publication,
		Stream:           c.stream,
		SubjectPrefix:    c.subjectPrefix,
		DuplicateWindow:  natssink.DefaultDuplicateWindow,
		AckTimeout:       natssink.DefaultAckTimeout,
		MaxInFlight:      relay.DefaultMaxInFlight,
		MaxInFlightBytes: relay.DefaultMaxInFlightBytes,
		MaxBufferedBytes: relay.DefaultMaxBufferedBytes,
		StatusInterval:   relay.DefaultStatusInterval,
		DrainTimeout:     relay.DefaultDrainTimeout,
	}
	if c.onPublish != "" {
		if o.Policy, err = store.ParsePolicy(c.onPublish); err != nil {
			return app.Options{}, err
		}
	}
	if o.Format, err = c.format(t); err != nil {
		return app.Options{}, err
	}
	return o, nil
}

// db is the database the command's statements go to.
func (c *common) db() app.DB {
	return app.DB{URL: c.databaseURL, Password: c.dbPassword, Pooler: c.dbPooler}
}

// natsGiven reports whether the command was told where the broker is. status
// and redrive read the stream only then: both are useful without a broker,
// and the common default names a local server that an operator's machine
// rarely runs. An empty --nats-url says "skip" explicitly.
func (c *common) natsGiven(fs *flag.FlagSet) bool {
	return c.natsURL != "" && flagGiven(fs, flagNATSURL)
}

// connectNATS opens a short-lived connection with the common NATS flags,
// named "outbox-relay <command>" unless --nats-name says otherwise.
func (c *common) connectNATS(command string) (*nats.Conn, error) {
	return app.ConnectOnce(c.natsURL, c.nats, "outbox-relay "+command)
}

func flagGiven(fs *flag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	if _, ok := os.LookupEnv(config.EnvName(name)); ok {
		given = true
	}
	return given
}

// format is the message format the common flags say, with the default
// CloudEvents source named after the database the URL reaches.
func (c *common) format(t store.Table) (wire.Format, error) {
	f := wire.Format{SubjectPrefix: c.subjectPrefix, Source: c.ceSource}
	var err error
	if f.Mode, err = wire.ParseMode(c.messageFormat); err != nil {
		return wire.Format{}, err
	}
	if f.Mode != wire.ModeOutbox && f.Source == "" {
		db := ""
		if cfg, err := pgconn.ParseConfig(c.databaseURL); err == nil {
			db = cfg.Database
		}
		if db == "" {
			return wire.Format{}, fmt.Errorf("--message-format %s: the default --cloudevents-source names the database, and --database-url names none: give --cloudevents-source", f.Mode)
		}
		f.Source = wire.DefaultCloudEventsSource(db, t.Qualified())
	}
	if err := f.Validate(); err != nil {
		return wire.Format{}, err
	}
	return f, nil
}
