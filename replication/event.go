package replication

import (
	"time"

	"github.com/jackc/pglogrepl"
)

// EventType says which part of a committed transaction an Event carries.
type EventType uint8

const (
	// EventBegin opens a transaction. CommitLSN, CommitTime and Xid are set:
	// pgoutput's BEGIN already carries the commit's position and time, so rows
	// can flow before the COMMIT message arrives.
	EventBegin EventType = iota + 1
	// EventRow is one INSERT into the outbox table inside the open transaction.
	EventRow
	// EventCommit closes the transaction. EndLSN is the end of its commit
	// record: the position the slot may be confirmed to once every row of this
	// transaction (and of every earlier one) is settled.
	EventCommit
	// EventPosition says that every transaction committing before EndLSN
	// was handed over before it. The stream sends it between transactions,
	// only after StopAt, once the server's answer reaches that position.
	EventPosition
)

func (t EventType) String() string {
	switch t {
	case EventBegin:
		return "begin"
	case EventRow:
		return "row"
	case EventCommit:
		return "commit"
	case EventPosition:
		return "position"
	}
	return "unknown"
}

// Event is one step of the committed-transaction stream. With streaming off,
// pgoutput only sends transactions that have committed, whole and in commit
// order, so a Row is never a phantom (G2) even though it arrives before its
// Commit event.
type Event struct {
	Type       EventType
	Xid        uint32
	CommitLSN  pglogrepl.LSN // start of the commit record (pgoutput's "final LSN")
	EndLSN     pglogrepl.LSN // end of the commit record on EventCommit; the position on EventPosition
	CommitTime time.Time
	Row        *Row // set on EventRow only
}

// Row is an outbox row as it was inserted. Columns are mapped by name, so the
// table may gain columns or have them reordered without breaking decoding.
type Row struct {
	WorkID  string
	Kind    string
	Subject string // empty when the column is NULL
	// Payload is the payload column's value: jsonb's text as PostgreSQL
	// renders payload::text, json's text as inserted, bytea's bytes.
	Payload     []byte
	Binary      bool   // the payload column is bytea
	Headers     []byte // jsonb text, nil when NULL
	State       string
	AvailableAt time.Time
	Aggregate   *Aggregate // nil: the row is unordered (G12)
	ExpiresAt   time.Time  // zero: no business deadline (G13)
	CreatedAt   time.Time  // zero when the table has no such column
	// XactID is the inserting transaction's top-level id (the xact_id
	// column, G17); 0 when the table has no such column or it is NULL.
	XactID uint64
}

// Aggregate is the business object a row's work belongs to and the row's
// position in that object's sequence.
type Aggregate struct {
	Type, ID string
	Seq      int64
}

// LSN is a WAL position.
type LSN = pglogrepl.LSN
