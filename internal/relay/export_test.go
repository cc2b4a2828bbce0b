package relay

// Every test of the package runs with the loop's invariants asserted.
func init() { checkInvariants = true }

// GatePeak is the most events the CDC gate (--standby-slot) held at once.
func (r *Relay) GatePeak() int64 { return r.gatePeak.Load() }

// BufferedPeak is the most bytes of decoded rows a session held at once
// (replication.Budget, G15).
func (r *Relay) BufferedPeak() int64 {
	p := r.bufferedPeak.Load()
	if b := r.budget.Load(); b != nil {
		p = max(p, b.Peak())
	}
	return p
}

// BufferedHeld is the bytes of decoded rows the session holds now; 0
// between sessions.
func (r *Relay) BufferedHeld() int64 {
	if b := r.budget.Load(); b != nil {
		return b.Held()
	}
	return 0
}
