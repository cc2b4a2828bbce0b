package relay

import (
	"errors"
	"fmt"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// G7 for failures the sink does not recognise. A refusal the broker
// names is the row's rejection at once (the sink makes every 4xx answer
// about a message one), and a timeout, a disconnect or an error about the
// broker's stream or account is an outage. A failure that is neither
// (sinks.ErrUnrecognised) ends the session like an outage, and the next
// session meets the same row first: without a bound that is an endless
// replay, every row behind it held (a Nats-TTL the server could not parse
// did that: 8 sessions in 20 s, the stream stopped for good). So such
// failures are counted per row, and the maxUnrecognised-th is the row's
// rejection: it goes to the poller with its reason, the stream moves on.

// maxUnrecognised is how many sessions may end on the same row's
// unrecognised failure before it is rejected.
const maxUnrecognised = 3

// maxUnrecognisedRows bounds the rows counted: past it the counts start
// over (a flood of distinct failing rows is an outage, not a row's fault).
const maxUnrecognisedRows = 4096

// unrecognised counts unrecognised failures by work ID. It belongs to the
// session goroutine (sessions run one after another).
type unrecognised map[string]int

func (u *unrecognised) add(workID string) int {
	if *u == nil || len(*u) >= maxUnrecognisedRows {
		*u = unrecognised{}
	}
	(*u)[workID]++
	return (*u)[workID]
}

func (u unrecognised) forget(workID string) {
	if len(u) > 0 {
		delete(u, workID)
	}
}

// refusal says whether err, the failure of it's publish, is its rejection:
// a refusal the sink named, or an unrecognised failure of the same row for
// the maxUnrecognised-th time.
func (l *loop) refusal(it *item, err error) (*wire.RejectedError, bool) {
	if re, ok := wire.IsRejected(err); ok {
		return re, true
	}
	if !errors.Is(err, sinks.ErrUnrecognised) {
		return nil, false
	}
	n := l.r.unrecognised.add(it.workID)
	if n < maxUnrecognised {
		l.r.log.Warn().Str("work_id", it.workID).Int("tries", n).Err(err).
			Msg("publish failed in a way the relay does not recognise; ending the session as in an outage, and after 3 such failures of this row it is handed to the poller as refused")
		return nil, false
	}
	l.r.unrecognised.forget(it.workID)
	return &wire.RejectedError{Reason: wire.ReasonRefused, Err: fmt.Errorf("%d publishes in a row failed in a way the relay does not recognise, the last: %w", n, err)}, true
}
