package relay

import (
	"reflect"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// TestCDCSharedHeaders: the fast build gives exactly the headers the
// generic one does, for LSNs with and without letters and zero halves, and
// for commit times in and out of UTC, with and without sub-seconds.
func TestCDCSharedHeaders(t *testing.T) {
	zone := time.FixedZone("x", 5*3600)
	for _, lsn := range []pglogrepl.LSN{0, 1, 0x16B3748, 0xABCDEF0123456789, 0xFFFFFFFFFFFFFFFF, 0x100000000} {
		for _, ct := range []time.Time{
			time.Date(2026, 12, 2, 14, 0, 0, 0, time.UTC),
			time.Date(2026, 12, 2, 14, 0, 0, 123456000, zone),
			time.Date(1999, 1, 2, 3, 4, 5, 100, time.UTC),
		} {
			got := cdcSharedHeaders(lsn, ct)
			want := wire.SharedHeaders(CDCHeaders(lsn, ct))
			if !reflect.DeepEqual(got, want) {
				t.Errorf("lsn %s time %v: got %v, want %v", lsn, ct, got, want)
			}
		}
	}
}

func BenchmarkCDCHeaders(b *testing.B) {
	ct := time.Now()
	b.Run("generic", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			_ = wire.SharedHeaders(CDCHeaders(pglogrepl.LSN(i)<<20, ct))
		}
	})
	b.Run("shared", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			_ = cdcSharedHeaders(pglogrepl.LSN(i)<<20, ct)
		}
	})
}
