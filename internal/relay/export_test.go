package relay

// GatePeak is the most events the CDC gate (--standby-slot) held at once.
func (r *Relay) GatePeak() int64 { return r.gatePeak.Load() }
