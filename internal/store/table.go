package store

import (
	"github.com/outbox-relay/outbox-relay/internal/enqueue"
	"github.com/outbox-relay/outbox-relay/internal/table"
)

// DBTX is what a statement that takes no pool of its own runs on: a
// transaction, a connection or a pool (the producer's, enqueue.DBTX).
type DBTX = enqueue.DBTX

// Table names the outbox table (package table: the producer's package
// links the name rules without the store).
type Table = table.Table

// MaxTableName is the longest table name whose derived names all fit
// (table.MaxName).
func MaxTableName() int { return table.MaxName() }

// ParseTable reads the --table flag (table.Parse).
func ParseTable(s string) (Table, error) { return table.Parse(s) }
