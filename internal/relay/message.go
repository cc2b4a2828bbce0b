package relay

import (
	"strconv"
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

// cdcSharedHeaders is wire.SharedHeaders(CDCHeaders(...)) built in one go:
// at one row per transaction it runs once per message, and the two maps,
// fmt's formatting of the LSN and the three strings were a visible share of
// the relay's CPU per message (docs/benchmarks-cost.md). Both values live
// in one string and one slice; nothing downstream writes to them.
func cdcSharedHeaders(commitLSN pglogrepl.LSN, commitTime time.Time) map[string][]string {
	var buf [64]byte
	b := appendLSN(buf[:0], commitLSN)
	n := len(b)
	b = commitTime.UTC().AppendFormat(b, time.RFC3339Nano)
	s := string(b)
	vals := []string{s[:n], s[n:]}
	return map[string][]string{
		wire.HeaderCommitLSN:  vals[0:1:1],
		wire.HeaderCommitTime: vals[1:2:2],
	}
}

// appendLSN appends lsn as pglogrepl.LSN.String writes it (%X/%X).
func appendLSN(b []byte, lsn pglogrepl.LSN) []byte {
	b = appendUpperHex(b, uint32(lsn>>32))
	b = append(b, '/')
	return appendUpperHex(b, uint32(lsn))
}

func appendUpperHex(b []byte, v uint32) []byte {
	start := len(b)
	b = strconv.AppendUint(b, uint64(v), 16)
	for i := start; i < len(b); i++ {
		if c := b[i]; c >= 'a' && c <= 'f' {
			b[i] = c - 'a' + 'A'
		}
	}
	return b
}
