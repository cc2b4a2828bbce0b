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
