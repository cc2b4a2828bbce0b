package store

// The order statements (G12), for the scale tests in package store_test.

// HeldAggregatesSQL is HeldAggregates' statement.
func (s *Store) HeldAggregatesSQL() string { return s.heldAggregatesSQL() }

// WithPollerSQL is WithPoller's statement ($1 type, $2 id).
func (s *Store) WithPollerSQL() string { return s.withPollerSQL() }

// BlockedAggregatesSQL is BlockedAggregates' statement ($1 limit, $2
// BlockedLookAt, $3 BlockedLookAtLeast, $4 the table).
func (s *Store) BlockedAggregatesSQL() string { return s.blockedAggregatesSQL() }

// ExpireDueSQL is ExpireDue's statement.
func (s *Store) ExpireDueSQL() string { return s.expireDueSQL() }
