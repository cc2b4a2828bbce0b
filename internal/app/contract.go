package app

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// contractCheck runs the broker contract's checks (G21) at every session's
// start, against the stream as it is then: operators change streams and
// servers while the relay runs, and a reconnect may land on another server.
// A finding is logged when it first appears, not at every reconnect of a
// flapping broker; the metric always shows the last result.
type contractCheck struct {
	want       natssink.Contract
	nc         *nats.Conn
	monitorURL string
	log        zerolog.Logger
	m          *metrics.Metrics

	mu     sync.Mutex
	logged map[string]string // check -> the message last logged
}

func newContractCheck(o Options, nc *nats.Conn, log zerolog.Logger, m *metrics.Metrics) *contractCheck {
	want := natssink.Contract{DeadlineTTL: o.DeadlineTTL, AtomicBatches: o.AtomicTransactions}
	lease, backoff := o.Lease, o.BackoffMax
	if backoff >= lease && backoff > 0 {
		want.RetrySpan, want.RetrySpanFrom = backoff, "--backoff-max "+backoff.String()
	} else if lease > 0 {
		want.RetrySpan, want.RetrySpanFrom = lease, "--lease "+lease.String()
	}
	return &contractCheck{want: want, nc: nc, monitorURL: o.NATSMonitorURL, log: log.With().Str("component", "broker_contract").Logger(), m: m, logged: map[string]string{}}
}

// check compares info with the contract, logs what is new and refuses
// (natssink.ErrStreamConfig: no retry can fix it) where nothing could be
// delivered.
func (c *contractCheck) check(ctx context.Context, info *jetstream.StreamInfo) error {
	var sync *natssink.ServerSync
	if c.monitorURL != "" {
		mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		s, err := natssink.ReadServerSync(mctx, c.monitorURL)
		cancel()
		if err != nil {
			c.log.Warn().Err(err).Msg("could not read nats-server's sync setting from --nats-monitor-url; the check of the store's durability treats it as unknown")
		}
		sync = s
	}
	findings := natssink.CheckContract(info, c.nc.ConnectedServerVersion(), sync, c.want)
	c.m.BrokerContract.Reset()
	var refuse []string
	c.mu.Lock()
	defer c.mu.Unlock()
	seen := map[string]bool{}
	for _, f := range findings {
		c.m.BrokerContract.WithLabelValues(f.Check, f.Level).Set(1)
		seen[f.Check] = true
		if f.Level == natssink.LevelRefuse {
			refuse = append(refuse, f.String())
		}
		if c.logged[f.Check] == f.Msg {
			continue
		}
		c.logged[f.Check] = f.Msg
		ev := c.log.Warn()
		if f.Level == natssink.LevelRefuse {
			ev = c.log.Error()
		}
		ev.Str("check", f.Check).Str("stream", info.Config.Name).Str("fix", f.Fix).Msg(f.Msg)
	}
	for check := range c.logged {
		if !seen[check] {
			delete(c.logged, check)
			c.log.Info().Str("check", check).Str("stream", info.Config.Name).Msg("the broker now meets this check of the contract")
		}
	}
	if len(refuse) > 0 {
		return fmt.Errorf("%w: %s", natssink.ErrStreamConfig, strings.Join(refuse, "; "))
	}
	return nil
}
