package store

// The poller's statements, for the plan tests in package store_test.
var (
	CompleteSQL = completeSQL
	RenewSQL    = renewSQL
	ReleaseSQL  = releaseSQL
	Unplanned   = unplanned
)

// ClaimSQL is the claim statement.
func (s *Store) ClaimSQL(ordered bool) string { return s.claimSQL(ordered) }
