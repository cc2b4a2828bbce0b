// Package outbox writes messages into the transactional outbox that
// outbox-relay delivers to NATS JetStream.
//
// Call Enqueue in the same pgx transaction as the business change that calls
// for the message. The row then commits or rolls back with that change: a
// committed order always has its message on the way (the relay publishes
// every committed row at least once), and a rolled-back order never produces
// one.
//
//	tx, _ := pool.Begin(ctx)
//	defer tx.Rollback(ctx)
//	tx.Exec(ctx, `INSERT INTO orders ...`)
//	err := outbox.Enqueue(ctx, tx, outbox.Message{
//		WorkID:  "order-103-ack",
//		Kind:    "order.received",
//		Payload: []byte(`{"order_id":103,"total":"29.00"}`),
//	})
//	...
//	tx.Commit(ctx)
//
// Enqueue also accepts a *pgx.Conn or *pgxpool.Pool, but outside a
// transaction the guarantee is weaker: the business change and the intention
// are separate commits, so a crash between them keeps one without the other.
//
// # Identity
//
// WorkID names one intention, for good: it becomes the message's Nats-Msg-Id,
// which JetStream uses to drop repeats inside the stream's duplicate window,
// and which the consumer's inbox uses beyond it. Derive it from the business
// fact (order-103-ack), not from a random number per attempt, so that a
// retried request enqueues the same work_id again. Enqueue is idempotent on
// work_id, but never silently: a repeat with the same kind, subject and
// payload returns ErrAlreadyEnqueued and leaves the caller's transaction
// usable; a repeat that differs returns an error wrapping ErrConflict, since
// a changed intention behind an old identity would break every receiver's
// deduplication. A changed intention needs a new work_id.
//
// The check compares with the row still in the table. Once the relay deleted
// it (--on-publish delete) or `outbox-relay prune` removed it, the same
// work_id is accepted again as a new row; the consumer's inbox then drops the
// repeat.
//
// On a table partitioned by time (migrate --partition-interval) no index
// makes work_id unique; Enqueue and EnqueueBatch still find a repeat in any
// partition the table holds, by waiting for the other enqueues of the same
// work_id to end and then looking (docs/design-table.md, "Partitioned
// table"). Under REPEATABLE READ an enqueue that had to wait for another
// enqueue of its work_id fails with a serialization failure (40001), as a
// unique index would make it; retry the transaction.
//
// # Payload types
//
// The table's payload column is jsonb unless it was made with
// `outbox-relay migrate --payload-type json|bytea`; the producer reads which
// once per process, database and table (Producer.Prepare), with whether it
// is partitioned. In a jsonb table the payload must be JSON and is published
// as PostgreSQL's normalised text of it; in a json table it must be JSON and
// is published byte for byte; in a bytea table it may be any bytes
// (Protobuf, Avro, an empty message) and is published byte for byte:
//
//	b, _ := proto.Marshal(&orderpb.Received{OrderId: 103})
//	err := outbox.Enqueue(ctx, tx, outbox.Message{
//		WorkID:      "order-103-ack",
//		Kind:        "order.received",
//		Payload:     b,
//		ContentType: "application/x-protobuf",
//	})
//
// ContentType becomes the row's Content-Type header, which the relay copies
// into the message (and, with --message-format cloudevents, makes its
// datacontenttype); without it a consumer is told nothing, and CloudEvents
// says application/json for jsonb and json, application/octet-stream for
// bytea.
//
// # Validation
//
// Messages are checked before anything is sent to the database, with the
// rules the relay applies when it publishes: a row the relay would reject
// (an invalid subject, a reserved or malformed header) is refused here, where
// the caller can still fix it, instead of ending as a failed row.
package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/enqueue"
	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// DB is what Enqueue writes with: a pgx.Tx (recommended), *pgx.Conn,
// *pgxpool.Pool or *pgxpool.Conn.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Message is one intention to deliver.
type Message struct {
	// WorkID is the stable identity of this intention and the message's
	// Nats-Msg-Id. Required.
	WorkID string
	// Kind says what the work is. The relay publishes to
	// <subject-prefix><Kind> (default prefix "outbox.") unless Subject is
	// set. Required.
	Kind string
	// Subject, when set, is the NATS subject to publish to instead.
	Subject string
	// Payload is the message's data, checked against the table's payload
	// column (migrate --payload-type). jsonb, the default: JSON, published
	// as PostgreSQL's text of it, with key order and whitespace normalised,
	// so a consumer sees equal bytes for equal JSON on every delivery. json:
	// JSON, published byte for byte as given. bytea: any bytes, empty too
	// (a Protobuf message with only default fields), published byte for
	// byte. Any []byte can be assigned to it.
	Payload json.RawMessage
	// ContentType, when set, is the payload's media type (RFC 2046, e.g.
	// application/x-protobuf), written as the row's Content-Type header:
	// the relay copies it into the message and, with --message-format
	// cloudevents, makes it the datacontenttype. A Headers entry for
	// Content-Type (in any case) with another value is refused. A content
	// type other than JSON lets Validate take a payload that is not JSON;
	// the table still decides (a jsonb or json table takes JSON only).
	ContentType string
	// Headers are copied into the NATS message (e.g. traceparent). Names
	// starting with Nats- or Outbox- are reserved.
	Headers map[string]string
	// AvailableAt delays delivery until then (by the database's clock); the
	// relay's poller publishes it. Zero means now. Like ExpiresAt, it must
	// lie between 0001-01-01 and 9999-12-31 UTC.
	AvailableAt time.Time
	// Aggregate is the business object the work belongs to (an order, an
	// account). With it, the message takes the aggregate's next sequence
	// in the caller's transaction, and a relay run with --ordering
	// aggregate delivers the aggregate's messages in that order (G12).
	// Enqueues of one aggregate wait for each other's commit; different
	// aggregates never do. Zero: unordered.
	Aggregate Aggregate
	// Sequence, with Aggregate, is used instead of the counter: for
	// example the business row's own version. It must be unique within
	// the aggregate and start at 1 with no gaps, or InSequence consumers
	// wait for the missing ones.
	Sequence int64
	// ExpiresAt is the business deadline: the relay never publishes the
	// message after it (by the database's clock), and the message carries
	// it in Outbox-Expires-At for receivers that enforce it (G13). Zero:
	// none. It must lie between 0001-01-01 and 9999-12-31 UTC, the years
	// RFC 3339 can write (the table refuses others too).
	ExpiresAt time.Time
}

// Aggregate names a business object whose work must be done in order.
type Aggregate struct {
	Type, ID string
}

// ErrAlreadyEnqueued says a row with this work_id and the same kind, subject
// and payload already exists: the intention is recorded, nothing was
// written, and the caller's transaction is still usable. Retried requests
// usually treat it as success.
var ErrAlreadyEnqueued = errors.New("outbox: already enqueued with the same kind, subject and payload")

// ErrConflict says a row with this work_id already exists with a different
// kind, subject or payload. The returned error is a *ConflictError.
var ErrConflict = errors.New("outbox: work_id already enqueued with a different intention")

// ErrInvalid says a message was refused before reaching the database; the
// error says what to fix.
var ErrInvalid = errors.New("outbox: invalid message")

// ConflictError describes a work_id that is already stored with a different
// intention. errors.Is(err, ErrConflict) is true.
type ConflictError struct {
	WorkID string
	// Index is the message's position in EnqueueBatch's input, -1 for Enqueue.
	Index int
	// Differs names what differs: "kind", "subject", "payload".
	Differs []string
	// The stored row's values (StoredPayload as PostgreSQL prints the
	// column: jsonb's normalised text, json's text, bytea as \x hex).
	StoredKind, StoredSubject, StoredPayload string
}

func (e *ConflictError) Error() string {
	at := ""
	if e.Index >= 0 {
		at = fmt.Sprintf("message %d: ", e.Index)
	}
	payload := e.StoredPayload
	if len(payload) > 200 {
		payload = payload[:200] + "..."
	}
	return fmt.Sprintf("outbox: %swork_id %q is already enqueued with a different %s (stored kind %q, subject %q, payload %s); a changed intention needs a new work_id",
		at, e.WorkID, strings.Join(e.Differs, " and "), e.StoredKind, e.StoredSubject, payload)
}

func (e *ConflictError) Unwrap() error { return ErrConflict }

// Producer enqueues into one outbox table.
type Producer struct {
	table table.Table
}

// Option configures a Producer.
type Option func(*Producer) error

// WithTable names the outbox table: "name" (schema public) or "schema.name",
// the same value as the relay's --table. The default is "outbox".
func WithTable(name string) Option {
	return func(p *Producer) error {
		t, err := table.Parse(name)
		if err != nil {
			return fmt.Errorf("outbox.WithTable: %w", err)
		}
		p.table = t
		return nil
	}
}

// New returns a Producer; without options it writes to public.outbox.
func New(opts ...Option) (*Producer, error) {
	p := &Producer{table: table.Table{Schema: "public", Name: "outbox"}}
	for _, o := range opts {
		if err := o(p); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// Table is the schema-qualified table name the producer writes to.
func (p *Producer) Table() string { return p.table.Qualified() }

// Prepare reads how the table is laid out, plain or partitioned
// (migrate --partition-interval), and its payload column's type (migrate
// --payload-type), which the statements and the payload check depend on.
// The first enqueue into a table of a database reads it otherwise: one
// catalog lookup per process, database and table, which Prepare moves to
// start-up.
func (p *Producer) Prepare(ctx context.Context, db DB) error {
	if _, err := enqueue.LayoutOf(ctx, db, p.table); err != nil {
		return fmt.Errorf("outbox: prepare: %w", err)
	}
	return nil
}

var defaultProducer = &Producer{table: table.Table{Schema: "public", Name: "outbox"}}

// Enqueue inserts m into public.outbox with db (see Producer.Enqueue).
func Enqueue(ctx context.Context, db DB, m Message) error {
	return defaultProducer.Enqueue(ctx, db, m)
}

// EnqueueBatch inserts msgs into public.outbox with db (see
// Producer.EnqueueBatch).
func EnqueueBatch(ctx context.Context, db DB, msgs []Message) ([]Result, error) {
	return defaultProducer.EnqueueBatch(ctx, db, msgs)
}

// enqueueEach enqueues msgs one by one, in order: a batch with aggregates
// takes their sequences in input order, which one multi-row statement does
// not promise.
func (p *Producer) enqueueEach(ctx context.Context, db DB, msgs []Message) ([]Result, error) {
	results := make([]Result, len(msgs))
	var conflicts []error
	for i, m := range msgs {
		err := p.Enqueue(ctx, db, m)
		var ce *ConflictError
		switch {
		case err == nil:
			results[i] = Inserted
		case errors.Is(err, ErrAlreadyEnqueued):
			results[i] = AlreadyEnqueued
		case errors.As(err, &ce):
			ce.Index = i
			results[i] = Conflicted
			conflicts = append(conflicts, ce)
		default:
			return nil, fmt.Errorf("message %d: %w", i, err)
		}
	}
	return results, errors.Join(conflicts...)
}

// lostRowRetries bounds how often a repeat whose stored row vanished before
// it could be compared (deleted after publishing) is inserted again.
const lostRowRetries = 3

// Enqueue validates m and inserts it with db, normally the caller's
// transaction. It returns nil when it inserted the row, ErrAlreadyEnqueued
// when the same intention is already stored, an error wrapping ErrConflict
// when a different one is, and an error wrapping ErrInvalid when m was
// refused before reaching the database. None of these aborts the caller's
// transaction; a database error does, as any failed statement in PostgreSQL.
//
// The payload is checked against the table's payload column (see
// Message.Payload); the table's type is read once per process, database and
// table, and only a payload that is not JSON needs it to be checked.
func (p *Producer) Enqueue(ctx context.Context, db DB, m Message) error {
	if err := m.validateFields(); err != nil {
		return err
	}
	if err := p.payloadCheck(ctx, db)(m); err != nil {
		return err
	}
	row, err := toRow(m)
	if err != nil {
		return err
	}
	for range lostRowRetries {
		inserted, err := enqueue.One(ctx, db, p.table, row)
		if err != nil {
			return fmt.Errorf("outbox: enqueue: %w", err)
		}
		if inserted {
			return nil
		}
		cmp, err := enqueue.Compare(ctx, db, p.table, []enqueue.Row{row})
		if err != nil {
			return fmt.Errorf("outbox: enqueue: %w", err)
		}
		if len(cmp) != 1 {
			return fmt.Errorf("outbox: enqueue %q: comparison returned %d rows, want 1", m.WorkID, len(cmp))
		}
		if !cmp[0].Found {
			continue
		}
		if err := compared(cmp[0], -1); err != nil {
			return err
		}
		return ErrAlreadyEnqueued
	}
	return fmt.Errorf("outbox: enqueue %q: a row with this work_id existed at every insert and was gone at every comparison (%d times); is something deleting rows as they are written?", m.WorkID, lostRowRetries)
}

// Result is what EnqueueBatch did with one message.
type Result uint8

const (
	// Inserted: the row was written.
	Inserted Result = iota + 1
	// AlreadyEnqueued: the same intention was already stored; nothing written.
	AlreadyEnqueued
	// Conflicted: a different intention is stored under the work_id; nothing
	// written, and the returned error has a *ConflictError for it.
	Conflicted
)

func (r Result) String() string {
	switch r {
	case Inserted:
		return "inserted"
	case AlreadyEnqueued:
		return "already enqueued"
	case Conflicted:
		return "conflicted"
	}
	return fmt.Sprintf("Result(%d)", uint8(r))
}

// EnqueueBatch inserts many messages in one round trip (a second one only
// when some work_ids already exist, to compare them all at once). Every
// message is validated first, and a batch with an invalid message, or with a
// work_id twice, is refused whole (error wrapping ErrInvalid, nil results).
//
// Otherwise it returns one Result per message, in input order, and an error
// that joins a *ConflictError for every Conflicted message (errors.Is(err,
// ErrConflict)), or nil when there is none: repeats of the same intention are
// not errors in a batch, see the results. The messages that did not conflict
// are inserted in db; in a transaction, roll back to keep none of them.
func (p *Producer) EnqueueBatch(ctx context.Context, db DB, msgs []Message) ([]Result, error) {
	rows := make([]enqueue.Row, len(msgs))
	first := make(map[string]int, len(msgs))
	var errs []error
	checkPayload := p.payloadCheck(ctx, db)
	for i, m := range msgs {
		err := m.validateFields()
		if err == nil {
			err = checkPayload(m)
			if err != nil && !errors.Is(err, ErrInvalid) {
				return nil, fmt.Errorf("outbox: enqueue batch: %w", err) // reading the table's layout
			}
		}
		var r enqueue.Row
		if err == nil {
			r, err = toRow(m)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("message %d: %w", i, err))
			continue
		}
		if j, dup := first[m.WorkID]; dup {
			errs = append(errs, fmt.Errorf("%w: message %d: work_id %q already appears at message %d of the batch; enqueue an intention once", ErrInvalid, i, m.WorkID, j))
			continue
		}
		first[m.WorkID] = i
		rows[i] = r
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	for _, r := range rows {
		if r.Ordered() {
			return p.enqueueEach(ctx, db, msgs)
		}
	}
	results := make([]Result, len(msgs))
	if len(msgs) == 0 {
		return results, nil
	}
	pending := make([]int, len(msgs))
	for i := range pending {
		pending[i] = i
	}
	var conflicts []error
	for range lostRowRetries {
		batch := make([]enqueue.Row, len(pending))
		for k, i := range pending {
			batch[k] = rows[i]
		}
		inserted, err := enqueue.Rows(ctx, db, p.table, batch)
		if err != nil {
			return nil, fmt.Errorf("outbox: enqueue batch: %w", err)
		}
		var repeats []int
		for _, i := range pending {
			if inserted[rows[i].WorkID] {
				results[i] = Inserted
			} else {
				repeats = append(repeats, i)
			}
		}
		if len(repeats) == 0 {
			return results, errors.Join(conflicts...)
		}
		batch = batch[:0]
		for _, i := range repeats {
			batch = append(batch, rows[i])
		}
		cmp, err := enqueue.Compare(ctx, db, p.table, batch)
		if err != nil {
			return nil, fmt.Errorf("outbox: enqueue batch: %w", err)
		}
		if len(cmp) != len(repeats) {
			return nil, fmt.Errorf("outbox: enqueue batch: comparison returned %d rows, want %d", len(cmp), len(repeats))
		}
		pending = pending[:0]
		for k, i := range repeats {
			if !cmp[k].Found {
				pending = append(pending, i)
				continue
			}
			if err := compared(cmp[k], i); err != nil {
				results[i] = Conflicted
				conflicts = append(conflicts, err)
				continue
			}
			results[i] = AlreadyEnqueued
		}
		if len(pending) == 0 {
			return results, errors.Join(conflicts...)
		}
	}
	return nil, fmt.Errorf("outbox: enqueue batch: %d work_id(s), e.g. %q, existed at every insert and were gone at every comparison (%d times); is something deleting rows as they are written?", len(pending), rows[pending[0]].WorkID, lostRowRetries)
}

// compared turns a comparison into a *ConflictError, or nil when the stored
// row holds the same intention.
func compared(c enqueue.Comparison, index int) error {
	var differs []string
	if !c.SameKind {
		differs = append(differs, "kind")
	}
	if !c.SameSubject {
		differs = append(differs, "subject")
	}
	if !c.SamePayload {
		differs = append(differs, "payload")
	}
	if len(differs) == 0 {
		return nil
	}
	return &ConflictError{WorkID: c.WorkID, Index: index, Differs: differs,
		StoredKind: c.Kind, StoredSubject: c.Subject, StoredPayload: c.Payload}
}

// payloadCheck returns the check of a message's payload against the
// table's payload column: JSON (Message.Validate's rules) for jsonb and json;
// for bytea any bytes, unless the message's content type says JSON. A JSON
// payload passes for every table, so the table's type (cached: one catalog
// lookup per process, database and table) is asked for only when a payload
// is not JSON, and once per returned function. Without a database (nil) the
// table cannot be read, and the JSON rules apply.
func (p *Producer) payloadCheck(ctx context.Context, db DB) func(Message) error {
	var layout *enqueue.Layout
	return func(m Message) error {
		jsonErr := m.validateJSON()
		if jsonErr == nil || db == nil {
			return jsonErr
		}
		if layout == nil {
			l, err := enqueue.LayoutOf(ctx, db, p.table)
			if err != nil {
				return fmt.Errorf("outbox: work_id %q: %w", m.WorkID, err)
			}
			layout = &l
		}
		if layout.Binary() {
			if m.declaresJSON() {
				return fmt.Errorf("%w (its content type %q says JSON)", jsonErr, m.contentType())
			}
			return nil
		}
		return fmt.Errorf("%w; the payload column of %s is %s, which holds JSON only: other bytes (Protobuf, Avro, ...) need a bytea table (outbox-relay migrate --payload-type bytea)",
			jsonErr, p.table.Qualified(), layout.PayloadType)
	}
}

// toRow turns a validated m into the row's column values; ContentType
// joins the headers as Content-Type.
func toRow(m Message) (enqueue.Row, error) {
	r := enqueue.Row{WorkID: m.WorkID, Kind: m.Kind, Subject: m.Subject, Payload: string(m.Payload), AvailableAt: m.AvailableAt,
		AggregateType: m.Aggregate.Type, AggregateID: m.Aggregate.ID, AggregateSeq: m.Sequence, ExpiresAt: m.ExpiresAt}
	headers := m.Headers
	if _, _, ok := m.contentTypeHeader(); m.ContentType != "" && !ok {
		// validateFields refused a header that disagrees; one that agrees
		// stays as the caller named it.
		headers = make(map[string]string, len(m.Headers)+1)
		for k, v := range m.Headers {
			headers[k] = v
		}
		headers[wire.HeaderContentType] = m.ContentType
	}
	if len(headers) > 0 {
		b, err := json.Marshal(headers)
		if err != nil {
			return enqueue.Row{}, fmt.Errorf("outbox: work_id %q: encode headers: %w", m.WorkID, err)
		}
		h := string(b)
		r.Headers = &h
	}
	return r, nil
}

// sortedKeys gives validation errors a stable order.
func sortedKeys(h map[string]string) []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
