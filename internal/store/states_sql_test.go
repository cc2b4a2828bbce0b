package store

import "testing"

// The IN lists the statements carry, rendered from states.go, are the SQL
// they were written as before (the partial indexes and plans were tested
// with these).
func TestStateListsRenderAsSQL(t *testing.T) {
	for got, want := range map[string]string{
		blockingStatesSQL:         `('ready', 'scheduled', 'running', 'failed')`,
		withPollerStatesSQL:       `('scheduled', 'running', 'failed')`,
		sqlList([]string{"it's"}): `('it''s')`,
	} {
		if got != want {
			t.Errorf("rendered %s, want %s", got, want)
		}
	}
}
