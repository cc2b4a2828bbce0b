package replication

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/rs/zerolog"
)

// StreamConfig configures a Stream.
type StreamConfig struct {
	Slot        string
	Publication string
	Table       Table
	// CreatedAt asks for each row's created_at (Row.CreatedAt), which only
	// the CloudEvents formats read: parsing it costs every row otherwise.
	CreatedAt bool
	// StatusInterval is how often a standby status update goes out even when
	// nothing changed. Keep it well under half of the server's
	// wal_sender_timeout (60s by default), or the server drops the stream.
	StatusInterval time.Duration
	// Linger is how long a transaction may wait for the ones after it, so
	// that a trickle of small transactions reaches the relay (and the broker,
	// and the marks) in groups: one wake-up of each goroutine per group
	// instead of per message. A batch that fills goes at once; 0 hands each
	// transaction over as soon as its commit is read.
	Linger time.Duration
	// Budget bounds the bytes of the rows read and not yet given back by
	// the consumer (G15): while it has no room the stream stops reading
	// WAL, and keeps taking confirmations and sending status updates so the
	// server does not time it out. nil: rows are bounded by count only.
	Budget *Budget
	// RecordBound, when set, is called before a status update would
	// confirm a position more than BoundSlack past Bound, the highest
	// position recorded so far: it records pos durably (the relay's
	// <table>_slots.confirm_bound), so that a slot found later with a
	// confirmed position past the record was moved by someone else. An
	// error ends the stream without confirming past the record.
	RecordBound func(ctx context.Context, pos pglogrepl.LSN) error
	Bound       pglogrepl.LSN
	// Slots and StaleAfter fence a session that may have lost its
	// walsender (G18 across instances): a batch is handed over only while
	// the stream has evidence, at most StaleAfter old, that the server sent
	// it recently (the send times of the messages read, corrected for the
	// clocks' offset) or that this session's walsender holds the slot (a
	// query on Slots). WAL that sat in a network buffer or a paused process
	// past that, while the server dropped the session and another instance
	// streamed the slot, is not handed over: the stream ends instead. Nil
	// Slots or a zero StaleAfter: no fence.
	Slots      Querier
	StaleAfter time.Duration
	Logger     zerolog.Logger
}

// BoundSlack is how far past its recorded bound (StreamConfig.RecordBound)
// the stream confirms without recording a new one. The record's own WAL
// (a small UPDATE and its commit, a page image after a checkpoint) moves
// the server's position; an idle stream that confirmed that keepalive
// position, and recorded it first, would write again at every status
// update; past this slack it writes again only when the record itself
// carried a page image (the first change of the page after a checkpoint).
// A slot confirmed at most this far past the record is taken as the
// relay's: a hand advance by less than that goes unnoticed.
const BoundSlack = 2 << 10

// Stats are the stream's positions, readable from any goroutine.
type Stats struct {
	ServerWALEnd atomic.Uint64 // newest server WAL position heard of
	Confirmed    atomic.Uint64 // last position sent as flushed
	LastStatus   atomic.Int64  // unix nanos of the last status update sent
}

// Stream owns one replication connection from START_REPLICATION to close. One
// goroutine (Run) receives, decodes, sends status updates and shuts down;
// everything else talks to it through channels, because a PgConn is not safe
// for concurrent use.
type Stream struct {
	conn  *pgconn.PgConn
	cfg   StreamConfig
	dec   *Decoder
	log   zerolog.Logger
	stats *Stats

	confirmed pglogrepl.LSN // what the server was told
	acked     pglogrepl.LSN // what the relay confirmed (may be ahead of confirmed until the next update)
	bound     pglogrepl.LSN // the recorded bound of what may be confirmed (StreamConfig.RecordBound)
	lastEnd   pglogrepl.LSN // end LSN of the last COMMIT handed to the relay

	interruptDone chan struct{} // closed once Run's stop watcher has exited
	batch         []Event       // events read and not yet handed to the relay

	// prompt: send a status update as soon as the relay's confirmation
	// moves, not at the next status interval (ConfirmPromptly).
	prompt atomic.Bool
	// want: the caller wants the server's confirmed position at or past
	// it (ConfirmThrough). stopAt: hand over an EventPosition once every
	// transaction committing before it is handed over (StopAt). Both are
	// set from any goroutine; positionSent and nextAsk belong to Run.
	want, stopAt atomic.Uint64
	positionSent bool
	nextAsk      time.Time
	asks         int           // asks since the wanted position last changed
	askedFor     pglogrepl.LSN // the wanted position then

	// The fence (StreamConfig.StaleAfter), Run's own. alive is the newest
	// local time the walsender is known to have been sending or to have
	// held the slot; offset is the smallest receive time less the server's
	// send time seen (the clocks' offset plus the fastest delivery), so a
	// message's send time in local time is its server time plus offset,
	// never later than its receipt.
	alive     atomicTime
	offset    time.Duration
	offsetSet bool
	holder    int32 // this session's walsender, as pg_replication_slots names it
}

// promptWait is how long a receive waits in prompt mode before the stream
// looks for a confirmation to send.
const promptWait = 10 * time.Millisecond

// ConfirmPromptly makes the stream send each confirmation as soon as it
// has it, instead of at the next status interval. A stopping relay that
// waits for the server to see its confirmation past a position (a
// running-transactions record, so that the slot's restart_lsn moves)
// would otherwise wait up to a status interval per step. Safe from any
// goroutine.
func (s *Stream) ConfirmPromptly() { s.prompt.Store(true) }

// ConfirmThrough asks the stream to get the server's confirmed position to
// lsn or past it as soon as it safely can, instead of waiting for the next
// status interval and for a keepalive the server sends when it pleases:
// whenever everything handed over is confirmed and no transaction is open,
// it sends a status update that requests a reply, and the reply's position
// is confirmed (G10) and sent at once. A position the relay confirms past
// lsn is sent at once too. It never confirms past a row not settled (G3).
// The watermark of --on-publish none waits for this (G17). Safe from any
// goroutine; a lower lsn than one asked for before changes nothing.
func (s *Stream) ConfirmThrough(lsn pglogrepl.LSN) { atomicMax(&s.want, uint64(lsn)) }

// StopAt asks the stream to say when it has handed over every transaction
// that commits before lsn: between transactions, once the server's answer
// to a status update (which the stream requests until then) is at lsn or
// past it, the next batch carries an EventPosition with that answer. A
// transaction committing at or after lsn is handed over as usual; its Begin
// carries its CommitLSN. Safe from any goroutine; once only.
func (s *Stream) StopAt(lsn pglogrepl.LSN) { s.stopAt.CompareAndSwap(0, uint64(lsn)) }

func atomicMax(a *atomic.Uint64, v uint64) {
	for {
		old := a.Load()
		if v <= old || a.CompareAndSwap(old, v) {
			return
		}
	}
}

// askEvery paces the status updates that request the server's position
// (ConfirmThrough, StopAt): the server answers at once, so this bounds
// only the repeats while its position is still short of the one wanted,
// doubling up to the status interval.
const askEvery = 50 * time.Millisecond

// MaxBatch is the most events the stream hands over at once.
const MaxBatch = 128

// batches recycles event slices between the stream and the relay.
var batches = sync.Pool{New: func() any { b := make([]Event, 0, MaxBatch); return &b }}

func newBatch() []Event { return (*batches.Get().(*[]Event))[:0] }

// ReleaseBatch hands a batch the relay is done with back for reuse. The
// caller must not touch it afterwards.
func ReleaseBatch(b []Event) {
	if cap(b) != MaxBatch {
		return
	}
	clear(b[:cap(b)])
	b = b[:0]
	batches.Put(&b)
}

// Start issues START_REPLICATION at 0/0, so the server resumes at the slot's
// confirmed_flush_lsn: never at the server's current position, which would
// skip work that was streamed but not confirmed. slotConfirmed is the slot's
// confirmed_flush_lsn as read before starting; it is never reported lower.
func Start(ctx context.Context, conn *pgconn.PgConn, cfg StreamConfig, slotConfirmed pglogrepl.LSN, stats *Stats) (*Stream, error) {
	if cfg.StatusInterval <= 0 {
		cfg.StatusInterval = 2 * time.Second
	}
	if stats == nil {
		stats = &Stats{}
	}
	err := pglogrepl.StartReplication(ctx, conn, cfg.Slot, 0, pglogrepl.StartReplicationOptions{
		Mode: pglogrepl.LogicalReplication,
		PluginArgs: []string{
			"proto_version '1'",
			"publication_names '" + cfg.Publication + "'",
		},
	})
	if err != nil {
		return nil, fmt.Errorf("start replication on slot %s: %w", cfg.Slot, err)
	}
	stats.Confirmed.Store(uint64(slotConfirmed))
	st := &Stream{
		conn: conn, cfg: cfg, dec: newDecoder(cfg.Table, cfg.CreatedAt), log: cfg.Logger, stats: stats,
		confirmed: slotConfirmed, acked: slotConfirmed, lastEnd: slotConfirmed, bound: cfg.Bound,
		holder: int32(conn.PID()),
	}
	if cfg.Slots != nil && cfg.StaleAfter > 0 {
		// The walsender's own process ID, as the slot names it: behind a
		// pooler the connection's backend key names another process.
		si, err := LookupSlot(ctx, cfg.Slots, cfg.Slot)
		if err != nil {
			return nil, fmt.Errorf("start replication on slot %s: %w", cfg.Slot, err)
		}
		if si.Active && si.ActivePID != 0 {
			st.holder = si.ActivePID
		}
	}
	return st, nil
}

// Run streams events to out until ctx ends (an error path: return at once)
// or stop is closed (shutdown: stop reading WAL, keep taking confirmations
// until confirms is closed, send the last status update, return nil).
// confirms carries positions the relay has settled; a position may only be
// sent once every transaction ending at or before it is settled.
//
// Events go out in batches: a whole transaction, or MaxBatch events of a
// larger one, so the relay wakes once per transaction rather than once per
// message. The receiver owns a batch and may hand it back with ReleaseBatch.
func (s *Stream) Run(ctx context.Context, out chan<- []Event, confirms <-chan pglogrepl.LSN, stop <-chan struct{}) error {
	r := &run{s: s, ctx: ctx, out: out, confirms: confirms, stop: stop, netConn: s.conn.Conn()}
	r.drainer, _ = r.netConn.(*drainConn)
	r.ticker = time.NewTicker(s.cfg.StatusInterval)
	defer r.ticker.Stop()
	r.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	watchDone := make(chan struct{})
	defer close(watchDone)
	r.watchInterrupt(watchDone)
	r.lingerTimer = time.NewTimer(time.Hour)
	r.lingerTimer.Stop()
	defer r.lingerTimer.Stop()
	defer func() { _ = r.netConn.SetReadDeadline(time.Time{}) }()

	for {
		err := r.step()
		switch {
		case err == nil:
		case errors.Is(err, errStopped):
			return s.drain(ctx, confirms)
		case errors.Is(err, errConfirmsClosed):
			return s.sendStatus(ctx, false)
		default:
			return err
		}
	}
}

var (
	errStopped        = errors.New("stream stopped")
	errConfirmsClosed = errors.New("confirmations closed")
)

// run is one Run's state, owned by its goroutine.
type run struct {
	s        *Stream
	ctx      context.Context
	out      chan<- []Event
	confirms <-chan pglogrepl.LSN
	stop     <-chan struct{}

	ticker      *time.Ticker
	nextStatus  time.Time
	netConn     net.Conn
	drainer     *drainConn // the socket, when it can be drained without waiting; nil: by a short deadline
	interrupted atomic.Bool
	deadline    time.Time // the socket's read deadline
	lingerUntil time.Time // when the batch's first commit has waited Linger; zero: none waits
	lingerTimer *time.Timer
	// At a trickle (the last batch went out because nothing more came
	// within Linger), the stream does not read while a commit lingers: what
	// arrives meanwhile waits in the socket and is then taken with one read,
	// instead of a wake-up and a read per message. While WAL flows (batches
	// fill), it reads on.
	trickle, draining bool
}

// watchInterrupt ends a receive's wait at once on stop or ctx. A receive
// waits up to a status interval, through a read deadline on the socket
// rather than a context: pgconn watches a cancellable context with a
// goroutine per call, and at one call per WAL message that was the
// stream's largest cost. Without this an idle relay takes up to a status
// interval to shut down; moving the deadline to now leaves the connection
// usable for the last status update.
func (r *run) watchInterrupt(watchDone <-chan struct{}) {
	r.s.interruptDone = make(chan struct{})
	go func() {
		defer close(r.s.interruptDone)
		select {
		case <-r.stop:
		case <-r.ctx.Done():
		case <-watchDone:
			return
		}
		r.interrupted.Store(true)
		_ = r.netConn.SetReadDeadline(time.Now())
	}()
}

// step takes a confirmation, or sends a due status update and receives
// and handles one message. errStopped and errConfirmsClosed end Run.
func (r *run) step() error {
	s := r.s
	select {
	case <-r.stop:
		return errStopped
	case lsn, ok := <-r.confirms:
		if !ok {
			return errConfirmsClosed
		}
		s.ack(lsn)
		return nil
	default:
	}
	if !time.Now().Before(r.nextStatus) || s.acked > s.confirmed && (s.prompt.Load() || s.acked >= s.wanted()) {
		if err := s.sendStatus(r.ctx, false); err != nil {
			return err
		}
		r.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	}
	if r.askDue() && !time.Now().Before(s.nextAsk) {
		if err := s.sendStatus(r.ctx, true); err != nil {
			return err
		}
		// Backing off: a position the server does not reach soon waits
		// for WAL that is not written or flushed yet.
		w := s.wanted()
		if at := pglogrepl.LSN(s.stopAt.Load()); at != 0 && !s.positionSent {
			w = at
		}
		if w != s.askedFor {
			s.askedFor, s.asks = w, 0
		}
		s.nextAsk = time.Now().Add(min(askEvery<<min(s.asks, 8), s.cfg.StatusInterval))
		s.asks++
		r.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	}
	if again, err := r.linger(); again || err != nil {
		return err
	}
	if err := r.setDeadline(); err != nil {
		return err
	}
	drain := r.draining && r.drainer != nil
	if drain {
		r.drainer.draining.Store(true)
	}
	msg, err := s.conn.ReceiveMessage(context.Background())
	if drain {
		r.drainer.draining.Store(false)
	}
	if err != nil {
		return r.receiveFailed(err)
	}
	return r.handle(msg)
}

// wanted is the position ConfirmThrough asked for, or past every position
// when none is wanted beyond what the server has.
func (s *Stream) wanted() pglogrepl.LSN {
	if w := pglogrepl.LSN(s.want.Load()); w > s.confirmed {
		return w
	}
	return ^pglogrepl.LSN(0)
}

// askDue reports whether the server's answer to a status update could give
// what ConfirmThrough or StopAt wait for: never inside a transaction (the
// answer's position is then inside it); for a confirmation, only while
// everything handed over is confirmed (the answer's position is then safe
// to confirm, G10).
func (r *run) askDue() bool {
	s := r.s
	if s.dec.InTransaction() {
		return false
	}
	if s.stopAt.Load() != 0 && !s.positionSent {
		return true
	}
	w := s.wanted()
	return w != ^pglogrepl.LSN(0) && s.acked < w && s.acked >= s.lastEnd
}

// linger waits, at a trickle, until the batch's first commit has waited
// Linger, then sets a deadline just ahead: the next read takes what the
// socket holds, and the first read that would wait ends the batch. again:
// a confirmation came meanwhile; step is over.
func (r *run) linger() (again bool, err error) {
	s := r.s
	if !r.trickle || s.batch == nil || r.lingerUntil.IsZero() || r.draining {
		return false, nil
	}
	if d := time.Until(r.lingerUntil); d > 0 {
		r.lingerTimer.Reset(d)
		// What arrives meanwhile is read after the wait; hushed, it does
		// not wake the process on its way in either.
		r.drainer.hush()
		defer r.drainer.unhush()
		select {
		case <-r.stop:
			return false, errStopped
		case <-r.ctx.Done():
			return false, r.ctx.Err()
		case lsn, ok := <-r.confirmsThatAct():
			r.lingerTimer.Stop()
			if !ok {
				return false, errConfirmsClosed
			}
			s.ack(lsn)
			return true, nil
		case <-r.lingerTimer.C:
		}
	}
	r.draining = true
	r.deadline = time.Now().Add(drainWait)
	if err := r.netConn.SetReadDeadline(r.deadline); err != nil {
		return false, fmt.Errorf("set read deadline on slot %s: %w", s.cfg.Slot, err)
	}
	return false, nil
}

// confirmsThatAct is the confirmations to wake a lingering stream for:
// only those a step would act on at once (a prompt confirmation, a
// position ConfirmThrough or StopAt waits for). Any other one only raises
// what the next status update says: it waits in its channel (the latest
// replaces the one before) until the linger ends, instead of waking the
// stream once per group of acks.
func (r *run) confirmsThatAct() <-chan pglogrepl.LSN {
	s := r.s
	if s.prompt.Load() || s.stopAt.Load() != 0 || pglogrepl.LSN(s.want.Load()) > s.confirmed {
		return r.confirms
	}
	return nil
}

// setDeadline makes the next receive wake for the next status update, the
// lingering batch, or the drain's deadline, whichever comes first.
func (r *run) setDeadline() error {
	wake := r.nextStatus
	if r.draining {
		wake = r.deadline
	} else if r.s.batch != nil && !r.lingerUntil.IsZero() && r.lingerUntil.Before(wake) {
		wake = r.lingerUntil
	}
	if r.s.prompt.Load() {
		if p := time.Now().Add(promptWait); p.Before(wake) {
			wake = p
		}
	}
	if r.askDue() && r.s.nextAsk.Before(wake) {
		wake = r.s.nextAsk
	}
	if !wake.Equal(r.deadline) {
		r.deadline = wake
		if err := r.netConn.SetReadDeadline(r.deadline); err != nil {
			return fmt.Errorf("set read deadline on slot %s: %w", r.s.cfg.Slot, err)
		}
	}
	if r.interrupted.Load() {
		// The interrupt may have come before the deadline above replaced
		// it.
		_ = r.netConn.SetReadDeadline(time.Now())
	}
	return nil
}

// receiveFailed handles a receive that ended without a message: a stop, a
// deadline (the lingering batch goes out), or a failure.
func (r *run) receiveFailed(err error) error {
	select {
	case <-r.stop:
		if r.ctx.Err() == nil {
			return errStopped
		}
	default:
	}
	if !pgconn.Timeout(err) || r.ctx.Err() != nil {
		return fmt.Errorf("receive from slot %s: %w", r.s.cfg.Slot, err)
	}
	if r.s.batch != nil && !r.lingerUntil.IsZero() && (r.draining || !time.Now().Before(r.lingerUntil)) {
		r.trickle, r.draining = true, false
		return r.flush()
	}
	return nil
}

// handle takes one message from the server.
func (r *run) handle(msg pgproto3.BackendMessage) error {
	s := r.s
	switch msg := msg.(type) {
	case *pgproto3.CopyData:
		if len(msg.Data) == 0 {
			return nil
		}
		switch msg.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			return r.keepalive(msg.Data[1:])
		case pglogrepl.XLogDataByteID:
			return r.xlogData(msg.Data[1:])
		}
	case *pgproto3.ErrorResponse:
		return fmt.Errorf("slot %s: %w", s.cfg.Slot, pgconn.ErrorResponseToPgError(msg))
	default:
		s.log.Debug().Str("message", fmt.Sprintf("%T", msg)).Msg("unexpected message on replication connection")
	}
	return nil
}

func (r *run) keepalive(data []byte) error {
	s := r.s
	pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(data)
	if err != nil {
		return fmt.Errorf("parse keepalive on slot %s: %w", s.cfg.Slot, err)
	}
	s.noteServerEnd(pkm.ServerWALEnd)
	s.heard(pkm.ServerTime)
	// Nothing open, nothing in flight: the keepalive's position is safe to
	// confirm, which keeps an idle outbox in a busy database from holding
	// WAL (G10).
	if !s.dec.InTransaction() && s.acked >= s.lastEnd && pkm.ServerWALEnd > s.acked {
		s.acked = pkm.ServerWALEnd
		s.lastEnd = pkm.ServerWALEnd
	}
	if pkm.ReplyRequested {
		if err := s.sendStatus(r.ctx, false); err != nil {
			return err
		}
		r.nextStatus = time.Now().Add(s.cfg.StatusInterval)
	}
	// The answer comes in order after every message sent before it: no
	// transaction committing before its position is still to come.
	if at := pglogrepl.LSN(s.stopAt.Load()); at != 0 && !s.positionSent && !s.dec.InTransaction() && pkm.ServerWALEnd >= at {
		s.positionSent = true
		if s.batch == nil {
			s.batch = newBatch()
		}
		s.batch = append(s.batch, Event{Type: EventPosition, EndLSN: pkm.ServerWALEnd})
		r.trickle, r.draining = false, false
		return r.flush()
	}
	return nil
}

// xlogData decodes one WAL message into the batch, and hands the batch over
// once it is full, or at a commit unless the commit may linger.
func (r *run) xlogData(data []byte) error {
	s := r.s
	xld, err := pglogrepl.ParseXLogData(data)
	if err != nil {
		return fmt.Errorf("parse XLogData on slot %s: %w", s.cfg.Slot, err)
	}
	s.noteServerEnd(xld.ServerWALEnd)
	s.heard(xld.ServerTime)
	ev, ok, err := s.dec.Decode(xld.WALData)
	if err != nil {
		return fmt.Errorf("decode WAL at %s on slot %s: %w", xld.WALStart, s.cfg.Slot, err)
	}
	if !ok {
		return nil
	}
	if ev.Type == EventCommit {
		s.lastEnd = ev.EndLSN
	}
	if ev.Type == EventRow {
		if err := r.acquire(ev.Row.Size()); err != nil {
			return err
		}
	}
	if s.batch == nil {
		s.batch = newBatch()
	}
	s.batch = append(s.batch, ev)
	if len(s.batch) < MaxBatch {
		if ev.Type != EventCommit {
			return nil
		}
		if s.cfg.Linger > 0 {
			now := time.Now()
			if r.lingerUntil.IsZero() {
				r.lingerUntil = now.Add(s.cfg.Linger)
			}
			if r.trickle || now.Before(r.lingerUntil) {
				return nil
			}
		}
	}
	r.trickle, r.draining = false, false
	return r.flush()
}

// flush hands the batch read so far to the relay.
func (r *run) flush() error {
	s := r.s
	batch := s.batch
	s.batch = nil
	r.lingerUntil = time.Time{}
	if err := s.fence(r.ctx); err != nil {
		return err
	}
	return s.emit(r.ctx, r.out, batch, r.confirms, r.stop, r.ticker.C)
}

// heard notes a message the server stamped with its send time sent.
func (s *Stream) heard(sent time.Time) {
	if s.cfg.StaleAfter <= 0 || sent.IsZero() {
		return
	}
	now := time.Now()
	if d := now.Sub(sent); !s.offsetSet || d < s.offset {
		s.offset, s.offsetSet = d, true
	}
	s.alive.raise(sent.Add(s.offset))
}

// fenceTimeout bounds the query that checks who holds the slot.
const fenceTimeout = 10 * time.Second

// fence lets a batch through while the walsender is known to have been
// alive within StaleAfter; past that it asks the server whether this
// session's walsender still holds the slot, and ends the stream when it
// does not (or when it cannot tell).
func (s *Stream) fence(ctx context.Context) error {
	if s.cfg.Slots == nil || s.cfg.StaleAfter <= 0 || time.Since(s.alive.load()) <= s.cfg.StaleAfter {
		return nil
	}
	asked := time.Now()
	qctx, cancel := context.WithTimeout(ctx, fenceTimeout)
	defer cancel()
	si, err := LookupSlot(qctx, s.cfg.Slots, s.cfg.Slot)
	if err != nil {
		return fmt.Errorf("slot %s: the WAL read last was sent over %s ago, and who holds the slot could not be checked (ending the session without handing it over): %w", s.cfg.Slot, s.cfg.StaleAfter, err)
	}
	if !si.Active || si.ActivePID != s.holder {
		return fmt.Errorf("%w: slot %s: the WAL read last was sent over %s ago and the slot is held by walsender %d now, not by this session's %d: the server dropped this session meanwhile and another may have streamed it; ending it without handing that WAL over",
			ErrSessionFenced, s.cfg.Slot, s.cfg.StaleAfter, si.ActivePID, s.holder)
	}
	s.alive.raise(asked)
	return nil
}

// Fence is the fence for a row the relay took from an earlier batch and
// publishes only now: it was let through when its batch was handed over,
// but the process may have been paused since (SIGSTOP, a frozen VM) past
// wal_sender_timeout while another instance took the slot over and
// published the same rows. Cheap while the evidence is fresh; past
// StaleAfter it asks the server who holds the slot, as a handover does.
// Safe from any goroutine.
func (s *Stream) Fence(ctx context.Context) error { return s.fence(ctx) }

// atomicTime is a time read from any goroutine.
type atomicTime struct{ ns atomic.Int64 }

func (a *atomicTime) load() time.Time {
	if n := a.ns.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// raise moves the time forward to t, never back.
func (a *atomicTime) raise(t time.Time) {
	n := t.UnixNano()
	for {
		cur := a.ns.Load()
		if n <= cur || a.ns.CompareAndSwap(cur, n) {
			return
		}
	}
}

// ErrSessionFenced ends a stream whose walsender no longer holds the slot
// (StreamConfig.StaleAfter).
var ErrSessionFenced = errors.New("replication session fenced off")

// acquire takes n bytes of the budget for a decoded row, waiting for room
// without reading WAL: the rows read so far go to the consumer first (it
// cannot give back what it never got), then confirmations are taken and
// status updates sent while the consumer works the budget down. Only the
// row just decoded is held beyond the budget meanwhile.
func (r *run) acquire(n int) error {
	s := r.s
	b := s.cfg.Budget
	if b.TryAcquire(n) {
		return nil
	}
	if s.batch != nil {
		r.trickle, r.draining = false, false
		if err := r.flush(); err != nil {
			return err
		}
		if b.TryAcquire(n) {
			return nil
		}
	}
	for {
		select {
		case <-b.Room():
			if b.TryAcquire(n) {
				return nil
			}
		case lsn, ok := <-r.confirms:
			if !ok {
				return errStopped
			}
			s.ack(lsn)
		case <-r.ticker.C:
			if err := s.sendStatus(r.ctx, false); err != nil {
				return err
			}
			r.nextStatus = time.Now().Add(s.cfg.StatusInterval)
		case <-r.stop:
			return errStopped
		case <-r.ctx.Done():
			return r.ctx.Err()
		}
	}
}

// drainWait is how long a read after a lingering trickle waits for more:
// enough for the read to be tried, not enough to add latency.
const drainWait = 50 * time.Microsecond

// emit hands ev to the relay. While the relay pushes back (broker slow or
// down), it keeps taking confirmations and sending status updates, so the
// server does not time the connection out.
func (s *Stream) emit(ctx context.Context, out chan<- []Event, batch []Event, confirms <-chan pglogrepl.LSN, stop <-chan struct{}, tick <-chan time.Time) error {
	for {
		select {
		case out <- batch:
			return nil
		case lsn, ok := <-confirms:
			if !ok {
				return errStopped
			}
			s.ack(lsn)
		case <-tick:
			if err := s.sendStatus(ctx, false); err != nil {
				return err
			}
			// The relay may take the batch much later: the fence holds
			// for the time it is taken, not only for the time it was read.
			if err := s.fence(ctx); err != nil {
				return err
			}
		case <-stop:
			return errStopped
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// drain runs after stop: no more WAL is read; confirmations still arrive
// until the relay closes confirms, then the last position is sent.
func (s *Stream) drain(ctx context.Context, confirms <-chan pglogrepl.LSN) error {
	ticker := time.NewTicker(s.cfg.StatusInterval)
	defer ticker.Stop()
	for {
		select {
		case lsn, ok := <-confirms:
			if !ok {
				s.confirmIdleEnd(ctx)
				return s.sendStatus(ctx, false)
			}
			s.ack(lsn)
		case <-ticker.C:
			if err := s.sendStatus(ctx, false); err != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// finalKeepaliveWait bounds how long a stopping stream waits for the
// server's answer in confirmIdleEnd.
const finalKeepaliveWait = 500 * time.Millisecond

// confirmIdleEnd runs when the relay has settled everything it was given
// and is stopping: it asks the server for its position and, if the answer
// comes before any more WAL, confirms it. Without it the slot stays at the
// last outbox commit, behind everything written after it (the relay's own
// marks among it), and the next session's walsender decodes all of that WAL
// again before it reaches new rows. A keepalive arrives in order after the
// WAL sent before it, so when it comes first, nothing unread lies below its
// position; any WAL message instead means there is work for the next
// session, and the position stays where it is.
func (s *Stream) confirmIdleEnd(ctx context.Context) {
	if s.dec.InTransaction() || s.acked < s.lastEnd || ctx.Err() != nil {
		return
	}
	// The stop watcher moves the read deadline to now; it must be done
	// before the wait below sets its own.
	select {
	case <-s.interruptDone:
	case <-time.After(finalKeepaliveWait):
		return
	}
	netConn := s.conn.Conn()
	if err := netConn.SetReadDeadline(time.Now().Add(finalKeepaliveWait)); err != nil {
		return
	}
	defer func() { _ = netConn.SetReadDeadline(time.Now()) }()
	// The walsender answers between records with the end of what it has
	// read; the same answer twice means it is waiting for WAL, past
	// everything committed before the stop.
	var last pglogrepl.LSN
	for {
		if err := s.sendStatus(ctx, true); err != nil {
			return
		}
		msg, err := s.conn.ReceiveMessage(context.Background())
		if err != nil {
			return
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 || cd.Data[0] != pglogrepl.PrimaryKeepaliveMessageByteID {
			return
		}
		pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
		if err != nil {
			return
		}
		s.noteServerEnd(pkm.ServerWALEnd)
		if pkm.ServerWALEnd > s.acked {
			s.acked = pkm.ServerWALEnd
			s.lastEnd = pkm.ServerWALEnd
		}
		if pkm.ServerWALEnd == last {
			return
		}
		last = pkm.ServerWALEnd
	}
}

func (s *Stream) ack(lsn pglogrepl.LSN) {
	if lsn > s.acked {
		s.acked = lsn
	}
}

func (s *Stream) noteServerEnd(lsn pglogrepl.LSN) {
	if uint64(lsn) > s.stats.ServerWALEnd.Load() {
		s.stats.ServerWALEnd.Store(uint64(lsn))
	}
}

func (s *Stream) sendStatus(ctx context.Context, replyRequested bool) error {
	pos := s.acked
	if pos < s.confirmed {
		pos = s.confirmed
	}
	if s.cfg.RecordBound != nil && pos > s.bound+BoundSlack {
		if err := s.cfg.RecordBound(ctx, pos); err != nil {
			return fmt.Errorf("slot %s: confirm %s: %w", s.cfg.Slot, pos, err)
		}
		s.bound = pos
	}
	err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: pos,
		ReplyRequested:   replyRequested,
	})
	if err != nil {
		return fmt.Errorf("send standby status %s on slot %s: %w", pos, s.cfg.Slot, err)
	}
	if pos != s.confirmed {
		s.log.Debug().Str("lsn", pos.String()).Msg("confirmed")
	}
	s.confirmed = pos
	s.stats.Confirmed.Store(uint64(pos))
	s.stats.LastStatus.Store(time.Now().UnixNano())
	return nil
}
