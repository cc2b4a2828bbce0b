package relay

import (
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// CDCHeaders are the CDC path's headers: where and when the row committed,
// so a consumer can detect order changes after a broker fault.
func CDCHeaders(commitLSN pglogrepl.LSN, commitTime time.Time) map[string]string {
	return map[string]string{
		wire.HeaderCommitLSN:  commitLSN.String(),
		wire.HeaderCommitTime: commitTime.UTC().Format(time.RFC3339Nano),
	}
}
