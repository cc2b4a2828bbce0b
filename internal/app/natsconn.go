package app

import (
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"
)

// NATSAuth holds the broker's credentials and TLS files; empty fields are
// unused. Every command that talks to the broker reads the same flags into
// it (cmd/outbox-relay's common NATS flags), so the environment that lets
// run log in lets status, redrive, republish and demo log in too.
type NATSAuth struct {
	User, Password, Token string
	CredsFile, NKeyFile   string
	CAFile                string
	CertFile, KeyFile     string
	Name                  string
}

// Validate rejects combinations nats.go would accept and then fail on, or
// silently resolve one way, before anything connects.
func (a NATSAuth) Validate() error {
	if (a.CertFile == "") != (a.KeyFile == "") {
		return errors.New("--nats-tls-cert and --nats-tls-key go together: give both or neither")
	}
	if a.Token != "" && (a.User != "" || a.CredsFile != "" || a.NKeyFile != "") {
		return errors.New("--nats-token cannot be combined with --nats-user, --nats-creds or --nats-nkey: choose one way to authenticate")
	}
	if a.Password != "" && a.User == "" {
		return errors.New("--nats-password needs --nats-user")
	}
	if a.User != "" && (a.CredsFile != "" || a.NKeyFile != "") {
		return errors.New("--nats-user cannot be combined with --nats-creds or --nats-nkey: choose one way to authenticate")
	}
	if a.CredsFile != "" && a.NKeyFile != "" {
		return errors.New("--nats-creds already holds an NKey seed: drop --nats-nkey")
	}
	for _, f := range []struct{ flag, path string }{
		{"--nats-creds", a.CredsFile}, {"--nats-nkey", a.NKeyFile}, {"--nats-tls-ca", a.CAFile},
		{"--nats-tls-cert", a.CertFile}, {"--nats-tls-key", a.KeyFile},
	} {
		if f.path == "" {
			continue
		}
		fh, err := os.Open(f.path)
		if err != nil {
			return fmt.Errorf("%s: %w", f.flag, err)
		}
		fh.Close()
	}
	return nil
}

// Options are the nats.go options that authenticate and set up TLS: the one
// place that turns the flags into a login.
func (a NATSAuth) Options() ([]nats.Option, error) {
	var opts []nats.Option
	if a.User != "" || a.Password != "" {
		opts = append(opts, nats.UserInfo(a.User, a.Password))
	}
	if a.Token != "" {
		opts = append(opts, nats.Token(a.Token))
	}
	if a.CredsFile != "" {
		opts = append(opts, nats.UserCredentials(a.CredsFile))
	}
	if a.NKeyFile != "" {
		opt, err := nats.NkeyOptionFromSeed(a.NKeyFile)
		if err != nil {
			return nil, fmt.Errorf("--nats-nkey %s: %w", a.NKeyFile, err)
		}
		opts = append(opts, opt)
	}
	if a.CAFile != "" {
		opts = append(opts, nats.RootCAs(a.CAFile))
	}
	if a.CertFile != "" {
		opts = append(opts, nats.ClientCert(a.CertFile, a.KeyFile))
	}
	return opts, nil
}

// ConnectOnce opens a connection for a command that asks the broker a few
// questions and exits (status, redrive's lookup, republish, the demo's
// consumer): the relay's credentials and TLS, no reconnects, errors left to
// the caller instead of printed by nats.go. The error names the broker
// without secrets. name is the connection's name when --nats-name is empty.
func ConnectOnce(urls string, a NATSAuth, name string) (*nats.Conn, error) {
	scrub := NewNATSScrubber(urls, a)
	if err := a.Validate(); err != nil {
		return nil, err
	}
	if a.Name != "" {
		name = a.Name
	}
	opts := []nats.Option{
		nats.Name(name),
		// As the relay's: a broker answering its handshake late (1.3 s in
		// the chaos run's broker-slow) is slow, not absent.
		nats.Timeout(10 * time.Second),
		nats.MaxReconnects(0),
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}),
	}
	auth, err := a.Options()
	if err != nil {
		return nil, err
	}
	nc, err := nats.Connect(urls, append(opts, auth...)...)
	if err != nil {
		return nil, fmt.Errorf("connect to NATS at %s: %w", RedactNATSURLs(urls), scrub.Err(err))
	}
	return nc, nil
}
