package store

import "testing"

func TestSnapshotFinishedAndFirstRunning(t *testing.T) {
	s, err := ParseSnapshot("100:110:100,104,107")
	if err != nil {
		t.Fatal(err)
	}
	for xid, want := range map[uint64]bool{99: true, 100: false, 101: true, 104: false, 106: true, 107: false, 109: true, 110: false, 5000: false} {
		if got := s.Finished(xid); got != want {
			t.Errorf("Finished(%d) = %v, want %v", xid, got, want)
		}
	}
	cases := []struct {
		lo, hi, want uint64
		ok           bool
	}{
		{90, 99, 0, false},
		{101, 103, 0, false},
		{101, 109, 104, true},
		{105, 109, 107, true},
		{108, 109, 0, false},
		{108, 120, 110, true}, // xmax and above had not ended
		{115, 120, 115, true},
		{100, 100, 100, true},
		{5, 3, 0, false},
	}
	for _, c := range cases {
		got, ok := s.FirstRunning(c.lo, c.hi)
		if got != c.want || ok != c.ok {
			t.Errorf("FirstRunning(%d, %d) = %d, %v; want %d, %v", c.lo, c.hi, got, ok, c.want, c.ok)
		}
		// Every id below the answer in the range had ended.
		for x := c.lo; x <= c.hi && (!c.ok || x < c.want); x++ {
			if !s.Finished(x) {
				t.Errorf("FirstRunning(%d, %d) = %d, but %d had not ended", c.lo, c.hi, got, x)
			}
		}
	}
}

func TestSnapshotWithFinished(t *testing.T) {
	s, err := ParseSnapshot("100:110:100,104,107")
	if err != nil {
		t.Fatal(err)
	}
	if got := s.String(); got != "100:110:100,104,107" {
		t.Errorf("String() = %q", got)
	}
	// 104 was listed as running, 112 and 113 began after the snapshot; 500
	// is too far above xmax for a grow of 10.
	w, skipped := s.WithFinished([]uint64{104, 112, 113, 99, 500}, 10)
	if skipped != 1 {
		t.Errorf("skipped %d, want 1", skipped)
	}
	if got, want := w.String(), "100:114:100,107,110,111"; got != want {
		t.Errorf("WithFinished = %q, want %q", got, want)
	}
	for x := uint64(90); x < 600; x++ {
		want := s.Finished(x) || x == 104 || x == 112 || x == 113
		if got := w.Finished(x); got != want {
			t.Errorf("WithFinished: Finished(%d) = %v, want %v", x, got, want)
		}
	}
	if back, err := ParseSnapshot(w.String()); err != nil || back.String() != w.String() {
		t.Errorf("round trip of %q: %q, %v", w.String(), back.String(), err)
	}
	// Nothing to add: the same snapshot.
	if w, _ := s.WithFinished(nil, 10); w.String() != s.String() {
		t.Errorf("WithFinished(nil) = %q, want %q", w.String(), s.String())
	}
	e, _ := ParseSnapshot("200:200:")
	if w, _ := e.WithFinished([]uint64{200}, 10); w.String() != "200:201:" {
		t.Errorf("WithFinished on an empty list = %q, want 200:201:", w.String())
	}
}
