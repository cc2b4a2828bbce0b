package schema

import (
	"github.com/outbox-relay/outbox-relay/internal/enqueue"
	"github.com/outbox-relay/outbox-relay/internal/table"
)

// Table is the outbox table's name (internal/table).
type Table = table.Table

// DBTX is what a statement that takes no pool of its own runs on: a
// transaction, a connection or a pool.
type DBTX = enqueue.DBTX
