package store

import (
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// A producer could write 'infinity' and '-infinity' into every timestamptz
// column until migration 0008, and rows from then stay. pgx refuses to scan
// them into a time.Time, so every read of a producer-written time goes
// through these: the infinities become wire.Infinity and wire.NegInfinity,
// which compare with finite times as PostgreSQL's do and print as
// 'infinity' (wire.FormatTime).

// anyTime scans a NOT NULL timestamptz.
type anyTime struct{ t *time.Time }

func (a anyTime) ScanTimestamptz(v pgtype.Timestamptz) error {
	*a.t = fromPG(v)
	return nil
}

// anyTimePtr scans a nullable timestamptz: nil for NULL.
type anyTimePtr struct{ t **time.Time }

func (a anyTimePtr) ScanTimestamptz(v pgtype.Timestamptz) error {
	if !v.Valid {
		*a.t = nil
		return nil
	}
	t := fromPG(v)
	*a.t = &t
	return nil
}

func fromPG(v pgtype.Timestamptz) time.Time {
	switch v.InfinityModifier {
	case pgtype.Infinity:
		return wire.Infinity
	case pgtype.NegativeInfinity:
		return wire.NegInfinity
	}
	return v.Time
}

// sqlTimeText is PostgreSQL's text of a time for last_error and history: RFC
// 3339 in UTC to the microsecond, or the value's own text ('infinity',
// '-infinity', a year past 9999) where to_char has no RFC 3339 form for it
// (to_char of an infinity is NULL, which would blank the whole message).
func sqlTimeText(col string) string {
	return `CASE WHEN ` + col + ` >= '0001-01-01 00:00:00+00' AND ` + col + ` < '10000-01-01 00:00:00+00'
		THEN to_char(` + col + ` AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') ELSE ` + col + `::text END`
}
