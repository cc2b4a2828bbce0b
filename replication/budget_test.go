package replication

import "testing"

// The budget's rules: rows fit while their bytes do; a row larger than the
// whole budget passes only alone; a failed try marks the budget as waited
// on (Starved once, Waiting until a try succeeds) and a release then
// signals Room; the peak is what was held at once.
func TestBudgetRules(t *testing.T) {
	b := NewBudget(100)
	if !b.TryAcquire(60) || !b.TryAcquire(40) {
		t.Fatal("100 bytes did not fit a 100-byte budget")
	}
	if b.TryAcquire(1) {
		t.Fatal("a byte over the budget fitted")
	}
	if !b.Waiting() {
		t.Fatal("a failed try did not mark the budget as waited on")
	}
	select {
	case <-b.Starved():
	default:
		t.Fatal("a failed try did not signal Starved")
	}
	b.Release(60)
	select {
	case <-b.Room():
	default:
		t.Fatal("a release while waited on did not signal Room")
	}
	if !b.TryAcquire(1) || b.Waiting() {
		t.Fatal("a try after the release did not fit, or left the budget waited on")
	}
	b.Release(41)
	if b.Held() != 0 || b.Peak() != 100 {
		t.Fatalf("held %d, peak %d; want 0 and 100", b.Held(), b.Peak())
	}
	// Larger than the budget: alone, never beside anything.
	if !b.TryAcquire(10) {
		t.Fatal("10 bytes did not fit an empty budget")
	}
	if b.TryAcquire(500) {
		t.Fatal("a row larger than the budget passed beside another")
	}
	b.Release(10)
	if !b.TryAcquire(500) {
		t.Fatal("a row larger than the budget did not pass alone")
	}
	if b.Peak() != 500 {
		t.Fatalf("peak %d, want 500", b.Peak())
	}
	var none *Budget
	if !none.TryAcquire(1 << 30) {
		t.Fatal("a nil budget limited")
	}
	none.Release(1 << 30)
}
